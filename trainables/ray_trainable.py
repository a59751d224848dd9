"""The Ray Tune function trainable: one trial of any method, resumable from Tune checkpoints.

Tune passes ``{"spec": TrialSpec.to_dict(), **overrides}``; an override is either a TrialSpec
field (``lr``, ``clip_norm``, ...) or a method hyperparameter (``method_params.<name>``), which
is how a search space's samples reach the trial without the trainable knowing the space.
"""

from __future__ import annotations

import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from trainables.training import TrialSpec, train_trial

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


def dp_trainable(config: dict[str, Any]) -> None:
    """Function trainable: reports per-epoch metrics with a checkpoint each epoch."""
    from ray import tune

    spec = spec_from_tune_config(config)
    with tempfile.TemporaryDirectory(prefix="dpsweep-trial-") as tmp:
        resume_dir: Path | None = None
        checkpoint = tune.get_checkpoint()
        if checkpoint is not None:
            resume_dir = Path(checkpoint.to_directory(str(Path(tmp) / "resume")))

        def report(metrics: dict[str, Any], ckpt_dir: Path | None) -> None:
            ckpt = tune.Checkpoint.from_directory(str(ckpt_dir)) if ckpt_dir else None
            tune.report(metrics, checkpoint=ckpt)

        train_trial(spec, checkpoint_root=Path(tmp) / "ckpt", resume_from=resume_dir,
                    report=report)
