"""From a validated config to one trial's spec: the budget is matched here, not in the trial.

Keeping calibration in the orchestrator means a sweep asks the accountant once per distinct
question (cached on disk) and every trial receives the exact schedule it must train with.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.budget import calibrate, epsilon_curve
from orchestrator.config import Config
from trainables.data import DataSplits, SplitSizes, load_splits
from trainables.training import TrialSpec, poisson_plan


def load_data(cfg: Config) -> DataSplits:
    """The config's splits (cached in-process); bad data dirs or files raise UserInputError."""
    return load_splits(dataset=cfg.data.dataset, seed=cfg.data.split_seed,
                       sizes=SplitSizes(**cfg.split_sizes()), data_dir=cfg.data.data_dir or None)


def plan_trial(cfg: Config, *, method: str | None = None, trial_id: str = "trial",
               cache_dir: Path | None = None) -> TrialSpec:
    """Match the budget for the config's sampling plan and return the trial spec."""
    sizes = cfg.split_sizes()
    q, steps_per_epoch = poisson_plan(dataset_size=sizes["train"],
                                      batch_size=cfg.training.batch_size)
    epochs = cfg.training.epochs
    cal = calibrate(target_epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta, sample_rate=q,
                    steps=epochs * steps_per_epoch, cache_dir=cache_dir,
                    timeout_s=cfg.privacy.accountant_timeout_s)
    curve = epsilon_curve(cal, at_steps=[steps_per_epoch * (e + 1) for e in range(epochs)])
    return TrialSpec(
        method=method or cfg.training.method,
        lr=cfg.training.lr,
        clip_norm=cfg.training.clip_norm,
        epochs=epochs,
        batch_size=cfg.training.batch_size,
        calibration=cal.to_dict(),
        epsilon_curve=[b.upper for b in curve],
        seed=cfg.training.seed,
        momentum=cfg.training.momentum,
        dataset=cfg.data.dataset,
        data_dir=cfg.data.data_dir or None,
        split_seed=cfg.data.split_seed,
        sizes=sizes,
        model=cfg.model.name,
        activation=cfg.model.activation,
        device=cfg.resources.device,
        threads=cfg.resources.cpus_per_trial,
        max_physical_batch=cfg.training.max_physical_batch,
        trial_id=trial_id,
    )
