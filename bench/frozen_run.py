"""The frozen-backbone recipe run end to end with ``dpsweep run`` (issue 41's acceptance).

``examples/frozen_backbone``: scikit-learn's digits as 32 x 32 RGB PNG class folders, a
torchvision ResNet-18 (GroupNorm) backbone loaded from one weights file and frozen, a
trainable ``Linear(512, 10)`` head; 600 / 200 / 300 / 189 / 500 examples; ``dpsgd``, 2 epochs
at batch 64, 4 trials, the default audit. The sweep runs as a user runs it (the CLI, Ray, the
default ``[audit]``) in a fresh run directory; the bench then reads each trial's
``result.json`` (training and audit seconds, as the trial measured them) and ``audit.json``
(its peak and the status of every layer).

Reported per trial: training and audit seconds, their ratio, the audit's parts (its references'
training and signals, everything up to scoring, the scoring), with the scoring again at the
sweep's end over the study's pooled references counted in the audit's seconds (the trials it
pooled and the references scored are listed), whether the peak MIA is finite,
and the layers the audit reported ``shared`` (frozen and identical in the target and every
reference). Results: ``bench/results/frozen_run.json``, whose table ``bench.docgen``
puts in ``docs/audit.md``.

Run from the repository root: ``.venv/bin/python -m bench.frozen_run`` (about 2 minutes on 2
cores).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import load_average, write_results
from dpsweep.core import layout

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "frozen_backbone"
RESULTS_NAME = "frozen_run"
#: The issue's bound on audit seconds over training seconds for this recipe.
MAX_RATIO = 10.0


def trial_row(trial_dir: Path) -> dict[str, Any]:
    """One trial's training and audit seconds, peak and shared layers, as it recorded them."""
    result = json.loads((trial_dir / layout.RESULT).read_text())
    audit = json.loads((trial_dir / layout.AUDIT).read_text())
    peak = audit.get("peak_mia_accuracy")
    pooled = audit.get("pooled") or {}
    # the audit scored again at the sweep's end with its study's references: its scoring
    # counts on top of what the trial measured
    pooling = audit["scoring_seconds"] if pooled else 0.0
    return {"trial_id": trial_dir.name, "train_seconds": result["train_seconds"],
            "audit_seconds": result["audit_seconds"] + pooling,
            "ratio": (result["audit_seconds"] + pooling) / result["train_seconds"],
            "trial_audit_seconds": result["audit_seconds"],
            "pooled_scoring_seconds": pooling, "pooled_trials": pooled.get("trials", []),
            "n_references": audit["n_references"],
            "references_train_seconds": sum(r["train_seconds"] for r in audit["references"]),
            "references_signal_seconds": sum(r["signal_seconds"] for r in audit["references"]),
            "collect_seconds": audit["reference_train_seconds"],
            "scoring_seconds": audit["scoring_seconds"],
            "peak_mia_accuracy": peak,
            "peak_finite": peak is not None and math.isfinite(peak),
            "shared_layers": [row["layer"] for row in audit.get("layers", [])
                              if row.get("status") == "shared"]}


def main() -> int:
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py")], check=True)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dpsweep.orchestrator.cli", "run",
                               str(EXAMPLE / "sweep.toml"), "--out", str(run_dir), "--quiet"],
                              cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            print(done.stdout + done.stderr)
            return done.returncode
        rows = [trial_row(d) for d in sorted((run_dir / layout.TRIALS).iterdir())
                if (d / layout.AUDIT).is_file()]
    dp = [r for r in rows if r["trial_id"] != "nonprivate"]
    for r in rows:
        print(f"{r['trial_id']:<16} train {r['train_seconds']:5.1f} s  audit "
              f"{r['audit_seconds']:5.1f} s  ratio {r['ratio']:4.1f}  peak "
              f"{r['peak_mia_accuracy']}  shared {r['shared_layers']}")
    summary = {"median_ratio": statistics.median(r["ratio"] for r in dp),
               "max_ratio": max(r["ratio"] for r in dp), "bound": MAX_RATIO,
               "all_peaks_finite": all(r["peak_finite"] for r in rows),
               "all_backbones_shared": all(r["shared_layers"] for r in rows)}
    print(json.dumps(summary))
    write_results(RESULTS_NAME, {
        "bench": RESULTS_NAME, "issue": "41 acceptance", "command": "dpsweep run "
        "examples/frozen_backbone/sweep.toml", "trials": rows, "summary": summary,
        "wall_seconds": wall, "load_before": load_before, "load_after": load_average(),
        "python": platform.python_version()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
