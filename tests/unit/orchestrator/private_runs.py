"""The synthetic run (``bench.synthetic_run``) as a consistent private-tuning run, and the edits
someone with write access could make to its records: what the private selection's tests
(``test_private_selection.py``, ``test_pick.py``) start from."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from bench.synthetic_run import make_run
from dpsweep.core import layout
from dpsweep.core.storage import sha256_file
from dpsweep.core.toml import tomllib
from dpsweep.orchestrator.release.selection import SELECTED
from dpsweep.orchestrator.rundir import RunDir

#: Noisy scores of the synthetic run's trials: the best admissible one, t14, is degenerate (its
#: noiseless accuracy 0.15); t7 (not dp_valid), t13 (replayable) and t15 (a re-run) score higher.
NOISY_SCORES = {"t1": 0.80, "t4": 0.79, "t7": 0.99, "t13": 0.98, "t14": 0.95, "t15": 0.999}
CHOSEN = "t14"
#: A trial private tuning did not select.
OTHER = "t1"
#: The secret trial counts (at least one per search trial of the synthetic run).
COUNTS = {"dpsgd": 9, "ww_dpsgd": 9}
PLAN = {"mode": "private", "end_to_end_epsilon": 2.9812, "delta": 1e-5,
        "end_to_end_accountant": "rdp (dp_accounting RdpAccountant, RepeatAndSelectDpEvent)",
        "distribution": "poisson", "mean_trials": 10.0, "shape_eta": None,
        "score_noise_multiplier": 20.0, "per_trial_epsilon": 2.14,
        "statement": "End-to-end guarantee: (2.981, 1e-05)-DP for the selected model.",
        "expected_trials": 10.0, "prob_no_release": 4.5e-5}


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def set_tuning(run: Path, mode: str) -> None:
    """config.toml's sweep.tuning set to ``mode`` (not re-recorded), with what private tuning
    requires of the rest (one target, the audit after the selection)."""
    raw = tomllib.loads((run / layout.CONFIG).read_text())
    raw["sweep"]["tuning"] = mode
    raw["budget"]["epsilons"] = [3.0]
    raw["audit"]["in_trial"] = False
    (run / layout.CONFIG).write_text(tomli_w.dumps(raw))


def rerecord(run: Path, *rels: str) -> None:
    """Rewrite the manifest entries of ``rels`` for their present content (or drop them), as an
    attacker with write access could: the manifest is a list of hashes, not a signature."""
    def edit(manifest: dict[str, Any]) -> None:
        for rel in rels:
            if (run / rel).is_file():
                manifest["files"][rel] = {"sha256": sha256_file(run / rel),
                                          "size": (run / rel).stat().st_size}
            else:
                manifest["files"].pop(rel, None)

    edit_json(run / layout.MANIFEST, edit)


def private_run(root: Path, *, scores: Mapping[str, float] = NOISY_SCORES,
                summary: bool = True) -> Path:
    """The synthetic run as a consistent private-tuning run (see the module docstring);
    ``summary=False``: a private sweep that has not finished (no summary.json written)."""
    def noisy(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if row["status"] == "ok" and row["method"] != "nonprivate":
                row["noisy_val_score"] = scores.get(row["trial_id"], 0.5)

    run = make_run(root, rows_hook=noisy)
    with RunDir.open(run, write=True) as opened:
        set_tuning(run, "private")
        (run / layout.PRIVATE_TUNING).write_text(json.dumps({"counts": COUNTS}))
        if summary:
            edit_json(run / layout.SUMMARY,
                       lambda s: s.update(tuning={**PLAN, SELECTED: CHOSEN}))
        else:
            (run / layout.SUMMARY).unlink()
        opened.record([layout.CONFIG, layout.PRIVATE_TUNING, layout.SUMMARY])
    return run
