"""The utility cost of private tuning on Fashion-MNIST, at one end-to-end epsilon.

Three DP-SGD sweeps of the same model, data and schedule, each releasing one model:

* ``private``: ``sweep.tuning = "private"`` at end-to-end epsilon T (Papernot & Steinke 2022):
  random search, a Poisson number of trials with mean N, a noisy validation score; the
  released model is the best noisy score. T covers training and selection.
* ``tpe_matched``: TPE with N trials whose per-trial noise is set so that the N DP-SGD runs
  compose (dp_accounting PLD, exactly) to T. T then covers releasing all N models, and so any
  choice among them made from validation metrics, but not the adaptive proposals' dependence on
  the validation set (see ``orchestrator.accounting.tuning.adaptive.adaptive_statement``):
  generous to TPE.
* ``tpe_naive``: TPE with N trials at per-trial epsilon T, the common practice; its composed
  epsilon over N trials is printed beside it.

The figure of merit is the released model's test accuracy (selected on validation, or on the
noisy score). Writes bench/results/private_tuning.json.

    .venv/bin/python -m bench.private_tuning [--epsilon 3] [--trials 6] [--repeats 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import write_results
from dpsweep.core.errors import UserInputError
from dpsweep.core.vocabulary import VALIDATION_OBJECTIVE
from dpsweep.orchestrator import api
from dpsweep.orchestrator.api import from_dict
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.door import check
from dpsweep.reports.pick import choose_private

#: The study's split sizes and schedule (configs/fmnist.toml), DP-SGD only, no audit.
BASE: dict[str, Any] = {
    "data": {"dataset": "fashion-mnist", "train_size": 8000, "validation_size": 2000,
             "holdout_size": 2200, "test_size": 10000, "shadow_size": 10000},
    "model": {"name": "cnn28"},
    "privacy": {"delta": 1e-5},
    "training": {"batch_size": 256, "epochs": 5},
    "sweep": {"methods": ["dpsgd"], "max_concurrent_trials": 2, "baseline": False},
    "audit": {"enabled": False},
}
#: Bisection steps on log sigma for the matched TPE budget.
BISECTION_STEPS = 40


def _config(*, epsilon: float, trials: int, tuning: str, seed: int) -> Config:
    raw = {k: dict(v) for k, v in BASE.items()}
    raw["budget"] = {"epsilons": [epsilon]}
    raw["sweep"].update({"trials_per_method": trials, "tuning": tuning, "seed": seed})
    if tuning == "private":
        raw["sweep"]["expected_trials"] = float(trials)
    return from_dict(raw)


def matched_per_trial_epsilon(*, cfg: Config, n_trials: int, end_to_end: float) -> dict[str, Any]:
    """The per-trial epsilon whose N exactly composed DP-SGD runs reach ``end_to_end``."""
    from dpsweep.core.poisson import poisson_plan
    from dpsweep.core.schedule import Schedule
    from dpsweep.orchestrator.accounting.calibration import certify
    from dpsweep.orchestrator.accounting.tuning.adaptive import adaptive_statement

    q, per_epoch = poisson_plan(dataset_size=cfg.data.train_size,
                                batch_size=cfg.training.batch_size)
    steps = per_epoch * cfg.training.epochs
    delta = cfg.privacy.delta

    def composed(sigma: float) -> float:
        return adaptive_statement(n_trials=n_trials, per_trial_epsilon=1.0, delta=delta,
                                  objectives=(VALIDATION_OBJECTIVE,),
                                  sample_rate=q,
                                  schedule=Schedule.constant(noise_multiplier=sigma,
                                                             steps=steps)).composed_epsilon

    lo, hi = math.log(0.3), math.log(50.0)
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if composed(math.exp(mid)) > end_to_end else (lo, mid)
    sigma = math.exp(hi)
    per_trial = certify(schedule=Schedule.constant(noise_multiplier=sigma, steps=steps),
                        sample_rate=q, delta=delta).bounds.upper
    return {"sigma": sigma, "per_trial_epsilon": per_trial, "composed": composed(sigma),
            "sample_rate": q, "steps": steps}


def _released(frame: Any, *, private: bool) -> dict[str, Any]:
    """The model each arm releases: private tuning's is pick's (the best noisy score, no
    noiseless filter); TPE's the best validation accuracy among non-degenerate trials."""
    if private:
        try:
            best = choose_private(frame).trial
        except UserInputError:
            return {"trials": len(frame), "released": None}
    else:
        ok = frame[(frame["status"] == "ok") & ~frame["degenerate"].astype(bool)]
        if ok.empty:
            return {"trials": len(frame), "released": None}
        best = ok.loc[ok["val_accuracy"].astype(float).idxmax()]
    return {"trials": len(frame), "released": str(best["trial_id"]),
            "val_accuracy": float(best["val_accuracy"]),
            "test_accuracy": float(best["test_accuracy"]),
            "sigma": float(best["noise_multiplier"]), "epsilon_upper": float(best["epsilon_upper"]),
            "all_test_accuracy": [float(x) for x in frame["test_accuracy"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=3.0, help="end-to-end target")
    parser.add_argument("--trials", type=int, default=6,
                        help="TPE trials, and the mean number of private-tuning trials")
    parser.add_argument("--repeats", type=int, default=1, help="repeats of the three sweeps")
    args = parser.parse_args()
    from dpsweep.orchestrator.accounting.tuning.adaptive import adaptive_statement
    from dpsweep.orchestrator.sweep.tuning import private_tuning_plan

    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="dpsweep-private-tuning-"))
    try:
        for repeat in range(args.repeats):
            private_cfg = _config(epsilon=args.epsilon, trials=args.trials, tuning="private",
                                  seed=repeat)
            plan = private_tuning_plan(check(private_cfg)).to_dict()
            matched = matched_per_trial_epsilon(cfg=private_cfg, n_trials=args.trials,
                                                end_to_end=args.epsilon)
            naive = adaptive_statement(n_trials=args.trials, per_trial_epsilon=args.epsilon,
                                       delta=private_cfg.privacy.delta,
                                       objectives=(VALIDATION_OBJECTIVE,))
            arms = {
                "private": (private_cfg, {"end_to_end_epsilon": plan["end_to_end_epsilon"],
                                          "per_trial_training_epsilon":
                                              plan["per_trial_training_epsilon"],
                                          "sigma": plan["schedule"][0]["noise_multiplier"]
                                          if isinstance(plan["schedule"][0], dict) else None}),
                "tpe_matched": (_config(epsilon=matched["per_trial_epsilon"] * (1 - 1e-6),
                                        trials=args.trials, tuning="adaptive", seed=repeat),
                                {"end_to_end_epsilon_of_all_models": matched["composed"],
                                 "per_trial_epsilon": matched["per_trial_epsilon"],
                                 "selection": "adaptive proposals not covered"}),
                "tpe_naive": (_config(epsilon=args.epsilon, trials=args.trials,
                                      tuning="adaptive", seed=repeat),
                              {"end_to_end_epsilon_of_all_models": naive.composed_epsilon,
                               "composed_delta": naive.composed_delta,
                               "per_trial_epsilon": args.epsilon}),
            }
            for arm, (cfg, privacy) in arms.items():
                out = work / f"{arm}-{repeat}"
                started = time.perf_counter()
                api.run(dataclasses.replace(cfg), out=out, quiet=True)
                seconds = time.perf_counter() - started
                row = {"arm": arm, "repeat": repeat, "seconds": seconds, **privacy,
                       **_released(api.results(out), private=arm == "private")}
                rows.append(row)
                print(f"{arm:12s} repeat {repeat}: {row.get('trials')} trials, released "
                      f"{row.get('released')} test {row.get('test_accuracy', math.nan):.4f} "
                      f"(val {row.get('val_accuracy', math.nan):.4f}), {seconds:.0f} s; "
                      f"{privacy}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = write_results("private_tuning", {"epsilon": args.epsilon, "trials": args.trials,
                                            "config": BASE, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
