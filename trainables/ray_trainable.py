"""Running one trial under Ray Tune: per-epoch reports with checkpoints, exact resume.

``run_in_tune`` is the piece every Tune function trainable shares: it resumes from
``tune.get_checkpoint()`` when Tune restarts the trial, reports each epoch's metrics with a
checkpoint, and leaves the final artifacts (last checkpoint, privacy record, history, spec) in
``out_dir`` for the results store. ``dp_trainable`` is the plain function trainable built on it;
the sweep's trainable (orchestrator/sweep.py) adds budget planning and the audit around it.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from trainables.data import DataSplits
from trainables.training import TrialResult, TrialSpec, train_trial

_SPEC_FIELDS = {f.name for f in fields(TrialSpec)}


def spec_from_tune_config(config: dict[str, Any]) -> TrialSpec:
    """Merge Tune's sampled overrides into the base spec."""
    base = dict(config["spec"])
    params = dict(base.get("method_params") or {})
    for key, value in config.items():
        if key == "spec":
            continue
        if key.startswith("method_params."):
            params[key.split(".", 1)[1]] = value
        elif key in _SPEC_FIELDS:
            base[key] = value
        else:
            raise KeyError(f"unknown trial override {key!r}")
    base["method_params"] = params
    return TrialSpec.from_dict(base)


def run_in_tune(spec: TrialSpec, *, data: DataSplits | None = None,
                out_dir: Path | None = None) -> TrialResult:
    """Train under Tune; the final checkpoint and records are copied into ``out_dir``."""
    from ray import tune

    with tempfile.TemporaryDirectory(prefix="dpsweep-trial-") as tmp:
        resume_dir: Path | None = None
        checkpoint = tune.get_checkpoint()
        if checkpoint is not None:
            resume_dir = Path(checkpoint.to_directory(str(Path(tmp) / "resume")))

        def report(metrics: dict[str, Any], ckpt_dir: Path | None) -> None:
            ckpt = tune.Checkpoint.from_directory(str(ckpt_dir)) if ckpt_dir else None
            tune.report(metrics, checkpoint=ckpt)

        root = Path(tmp) / "ckpt"
        result = train_trial(spec, data=data, checkpoint_root=root, resume_from=resume_dir,
                             report=report)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            for name in ("privacy.json", "history.json", "spec.json"):
                shutil.copy2(root / name, out_dir / name)
            final = out_dir / f"epoch_{spec.epochs:03d}"
            if final.exists():
                shutil.rmtree(final)
            assert result.checkpoint_dir is not None
            shutil.copytree(result.checkpoint_dir, final)
            result.checkpoint_dir = final
        return result


def dp_trainable(config: dict[str, Any]) -> None:
    """Function trainable for a ready spec: ``{"spec": TrialSpec.to_dict(), **overrides}``."""
    run_in_tune(spec_from_tune_config(config))
