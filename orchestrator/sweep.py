"""The sweep: Ray Tune runs the trials, Optuna picks their hyperparameters, all at one budget.

How methods share trials: **one Optuna study per method, with equal trial budgets**, run one
method after another (trials of a method run concurrently). A fair comparison needs each
method tuned with the same effort, and each method has its own conditional hyperparameters;
a single study with a categorical method choice lets TPE starve the methods that start badly
and models conditional spaces poorly. Each study's first trial is the method's paper preset.

Objectives: with the audit inside the trial (default), two — test accuracy (max) and peak-layer
MIA accuracy (min) — through ``OptunaSearch(metric=[...], mode=[...])``; otherwise test accuracy
alone and the audit runs after all trials. No ASHA or other early stopping: a stopped trial
would enter the front as if complete. Trials report only finite values; a trial that diverges
or fails raises, Optuna is told FAIL (not COMPLETE with a stale value), its row is recorded with
the reason, and the sweep goes on.

Layout of RUN_DIR: ``config.toml`` (as run), ``optuna.db`` (SQLite; open it with
optuna-dashboard), ``tune/<method>/`` (Ray Tune experiments, used by ``resume``),
``trials/<trial_id>/`` (final checkpoint, privacy.json, history.json, spec.json, audit.json),
``cache/`` (budget calibrations and LM-DP-SGD risk vectors), ``results.parquet`` and ``report/``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from core.errors import UserInputError
from orchestrator import config as config_mod
from orchestrator import results
from orchestrator.config import Config
from orchestrator.trial import load_data, plan_trial
from search_spaces import SearchSpace, build_space

OBJECTIVES = ["test_accuracy", "peak_mia_accuracy"]
MODES = ["max", "min"]
OPTUNA_DB = "optuna.db"
CONFIG_FILE = "config.toml"


def with_overrides(cfg: Config, *, method: str, overrides: dict[str, Any]) -> Config:
    """The config of one trial: the sweep's config, one method, the sampled hyperparameters.

    The config's own [method_params] and preset belong to single-trial runs; in a sweep each
    method starts from its defaults and the search space's values.
    """
    training = dataclasses.replace(cfg.training, method=method, preset="",
                                   lr=float(overrides.get("lr", cfg.training.lr)),
                                   clip_norm=float(overrides.get("clip_norm",
                                                                 cfg.training.clip_norm)))
    params = {k.split(".", 1)[1]: v for k, v in overrides.items()
              if k.startswith("method_params.")}
    return dataclasses.replace(cfg, training=training, method_params=params)


def _overrides(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items()
            if k in ("lr", "clip_norm") or k.startswith("method_params.")}


def trial_dir(run_dir: Path, trial_id: str) -> Path:
    return Path(run_dir) / results.TRIALS_DIR / trial_id


def sweep_trainable(config: dict[str, Any]) -> None:
    """Ray Tune function trainable: plan (cached budget) -> train -> audit -> final report."""
    from ray import tune

    from trainables.ray_trainable import run_in_tune

    run_dir = Path(config["run_dir"])
    method = config["method"]
    trial_id = f"{method}-{tune.get_context().get_trial_id()}"
    out = trial_dir(run_dir, trial_id)
    out.mkdir(parents=True, exist_ok=True)
    try:
        cfg = with_overrides(config_mod.from_dict(config["config"]), method=method,
                             overrides=_overrides(config))
        data = load_data(cfg)
        spec = plan_trial(cfg, trial_id=trial_id, cache_dir=run_dir / "cache", data=data)
        result = run_in_tune(spec, data=data, out_dir=out)
        final: dict[str, Any] = {"test_accuracy": result.test_accuracy,
                                 "epsilon_upper": result.privacy["epsilon_upper"],
                                 "train_seconds": result.seconds}
        if cfg.audit.enabled and cfg.audit.in_trial:
            from reports.audit import audit_trial

            audit = audit_trial(out / f"epoch_{spec.epochs:03d}", data=data,
                                shadow_models=cfg.audit.shadow_models, seed=cfg.audit.seed,
                                cache_dir=run_dir / "cache",
                                timeout_s=cfg.privacy.accountant_timeout_s, write_to=out)
            final["peak_mia_accuracy"] = audit.attack.peak.accuracy
        bad = [k for k, v in final.items() if not math.isfinite(float(v))]
        if bad:
            raise RuntimeError(f"non-finite final metrics {bad}: trial marked failed")
        tune.report(final)
    except Exception as exc:
        (out / "error.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise


def _failsafe_searcher_cls() -> type:
    """OptunaSearch that tells Optuna FAIL for errored or incomplete trials.

    Ray's OptunaSearch marks an errored trial COMPLETE when its last intermediate result has
    the metric (a stale value enters the front), and with several objectives a missing value
    makes ``study.tell`` raise and leaves a zombie RUNNING trial. Both are wrong for a sweep.
    """
    from optuna.trial import TrialState
    from ray.tune.search.optuna import OptunaSearch

    # Per-epoch results carry test accuracy only; the peak-MIA objective exists once the
    # trial's audit has run, so Tune's per-result check for every objective must be off.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"

    class FailSafeOptunaSearch(OptunaSearch):
        def on_trial_complete(self, trial_id: str, result: dict | None = None,
                              error: bool = False) -> None:
            metrics = self._metric if isinstance(self._metric, list) else [self._metric]
            values = [None if not result else result.get(m) for m in metrics]
            ok = not error and all(
                v is not None and math.isfinite(float(v)) for v in values)
            if ok or trial_id in self._completed_trials or trial_id not in self._ot_trials:
                super().on_trial_complete(trial_id, result=result, error=error)
                return
            self._ot_study.tell(self._ot_trials[trial_id], state=TrialState.FAIL)
            self._completed_trials.add(trial_id)

    return FailSafeOptunaSearch


class _ResultsCallback:
    """Driver-side: one results row per finished or failed trial, plus terminal progress."""

    def __init__(self, *, run_dir: Path, method: str, total: int, quiet: bool) -> None:
        self.run_dir = Path(run_dir)
        self.method = method
        self.total = total
        self.quiet = quiet
        self.start = time.time()
        self.done = 0
        self.failed = 0
        self.best: tuple[float, float] | None = None

    def _trial_id(self, trial: Any) -> str:
        return f"{self.method}-{trial.trial_id}"

    def complete(self, trial: Any) -> None:
        tid = self._trial_id(trial)
        out = trial_dir(self.run_dir, tid)
        try:
            row = _row_for(self.run_dir, out, config=trial.config)
        except Exception as exc:  # a record missing after a crash: keep the failure visible
            row = results.failed_row(trial_id=tid, method=self.method,
                                     error=f"results could not be read: {exc}")
        results.append_row(self.run_dir, row)
        if row["status"] == "ok":
            self.done += 1
            acc, peak = row["test_accuracy"], row.get("peak_mia_accuracy", math.nan)
            if self.best is None or acc > self.best[0]:
                self.best = (acc, peak)
        else:
            self.failed += 1
        self._progress(running=None)

    def error(self, trial: Any) -> None:
        tid = self._trial_id(trial)
        err_file = trial_dir(self.run_dir, tid) / "error.txt"
        reason = err_file.read_text() if err_file.is_file() else (
            str(getattr(trial, "error_msg", "") or "trial errored"))
        results.append_row(self.run_dir, results.failed_row(
            trial_id=tid, method=self.method, error=reason.strip().splitlines()[-1][:500]))
        self.failed += 1
        self._progress(running=None)

    def _progress(self, *, running: int | None) -> None:
        if self.quiet:
            return
        best = ("-" if self.best is None else
                f"acc {self.best[0]:.4f}" + ("" if math.isnan(self.best[1])
                                             else f", peak MIA {self.best[1]:.4f}"))
        print(f"[{self.method}] done {self.done}/{self.total}, failed {self.failed}, "
              f"best {best}, elapsed {time.time() - self.start:.0f} s", flush=True)


def _row_for(run_dir: Path, out: Path, *, config: dict[str, Any]) -> dict[str, Any]:
    import json

    spec = json.loads((out / "spec.json").read_text())
    privacy = json.loads((out / "privacy.json").read_text())
    history = json.loads((out / "history.json").read_text())
    row = results.row_from_trial(run_dir=run_dir, trial_dir=out, spec=spec, privacy=privacy,
                                 history=history,
                                 train_seconds=sum(m["epoch_seconds"] for m in history))
    audit_file = out / "audit.json"
    if audit_file.is_file():
        from reports.audit import fill_row_from_json

        row = fill_row_from_json(row, json.loads(audit_file.read_text()))
    del config
    return row


def _tune_callback(cb: _ResultsCallback) -> Any:
    from ray.tune import Callback

    class TuneResults(Callback):
        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            cb.complete(trial)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            cb.error(trial)

    return TuneResults()


def init_ray(*, address: str | None, quiet: bool) -> str:
    """Connect to a cluster (``--address`` or RAY_ADDRESS) or start a loopback-only local Ray."""
    # Ray Tune's own tables and per-checkpoint chatter would drown the progress lines.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"  # see _failsafe_searcher_cls
    import optuna
    import ray

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if ray.is_initialized():
        return "existing"
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                              "configure_logging": True,
                              "logging_level": "ERROR" if quiet else "WARNING"}
    if address:
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserInputError(field="--address", value=address,
                                 allowed=f"the address of a running Ray cluster ({exc})"
                                 ) from None
        return address
    ray.init(_node_ip_address="127.0.0.1", **kwargs)
    return "local"


def check_storage(run_dir: Path) -> None:
    """Every alive Ray node must read and write RUN_DIR (shared storage on a cluster)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    marker = Path(run_dir) / ".storage-probe"
    token = f"{socket.gethostname()}-{os.getpid()}-{time.time()}"
    marker.write_text(token)

    @ray.remote(num_cpus=0)
    def probe(path: str, expected: str) -> str:
        p = Path(path)
        seen = p.read_text() if p.is_file() else None
        if seen != expected:
            raise RuntimeError(f"cannot read {path} on {socket.gethostname()}")
        w = p.with_name(f".probe-{socket.gethostname()}-{os.getpid()}")
        w.write_text("ok")
        w.unlink()
        return socket.gethostname()

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=n["NodeID"], soft=False)).remote(str(marker), token) for n in nodes]
    try:
        ray.get(refs, timeout=120)
    except Exception as exc:
        raise UserInputError(field="RUN_DIR", value=str(run_dir),
                             allowed="a directory every Ray node can read and write (shared "
                                     f"storage on a cluster): {exc}") from None
    finally:
        marker.unlink(missing_ok=True)


def _num_layers(cfg: Config) -> int:
    from orchestrator.trial import _model_factory

    return len(_model_factory(cfg).layer_names)


def spaces_for(cfg: Config) -> dict[str, SearchSpace]:
    layers = _num_layers(cfg)
    return {m: build_space(m, num_layers=layers, lr=cfg.training.lr,
                           clip_norm=cfg.training.clip_norm) for m in cfg.sweep.methods}


def precompute(cfg: Config, *, run_dir: Path, spaces: dict[str, SearchSpace],
               quiet: bool) -> None:
    """Budgets and once-per-sweep preparations for every schedule the spaces can produce.

    Constant schedules are one calibration per sweep; categorical dimensions (e.g. AdamILG's k)
    are enumerated at the first point so trials only ever hit the cache.
    """
    from optuna.distributions import CategoricalDistribution

    data = load_data(cfg)
    for method, space in spaces.items():
        points = [dict(space.first_point)]
        for key, dist in space.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                points += [{**space.first_point, key: v} for v in dist.choices
                           if v != space.first_point.get(key)]
        t0 = time.perf_counter()
        for point in points:
            plan_trial(with_overrides(cfg, method=method, overrides=point),
                       cache_dir=run_dir / "cache", data=data)
        if not quiet:
            print(f"[{method}] budget and preparation: {len(points)} schedule(s) in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)


def _trial_name(trial: Any) -> str:
    return f"{trial.config.get('method', 'trial')}-{trial.trial_id}"


def _tuner(cfg: Config, *, run_dir: Path, method: str, space: SearchSpace, index: int,
           quiet: bool) -> Any:
    import optuna
    from ray import tune

    two = cfg.audit.enabled and cfg.audit.in_trial
    storage = optuna.storages.RDBStorage(f"sqlite:///{(run_dir / OPTUNA_DB).resolve()}")
    searcher = _failsafe_searcher_cls()(
        space=dict(space.distributions),
        metric=OBJECTIVES if two else OBJECTIVES[0], mode=MODES if two else MODES[0],
        points_to_evaluate=[dict(space.first_point)],
        sampler=optuna.samplers.TPESampler(seed=cfg.sweep.seed + index),
        study_name=method, storage=storage)
    trainable = tune.with_resources(sweep_trainable, {"cpu": cfg.resources.cpus_per_trial,
                                                      "gpu": cfg.resources.gpus_per_trial})
    callback = _ResultsCallback(run_dir=run_dir, method=method,
                                total=cfg.sweep.trials_per_method, quiet=quiet)
    return tune.Tuner(
        trainable,
        param_space={"run_dir": str(run_dir.resolve()), "config": cfg.to_dict(),
                     "method": method, **space.fixed},
        tune_config=tune.TuneConfig(search_alg=searcher,
                                    num_samples=cfg.sweep.trials_per_method,
                                    max_concurrent_trials=cfg.sweep.max_concurrent_trials,
                                    trial_name_creator=_trial_name,
                                    trial_dirname_creator=_trial_name),
        run_config=tune.RunConfig(
            name=method, storage_path=str((run_dir / "tune").resolve()), verbose=0,
            callbacks=[_tune_callback(callback)],
            failure_config=tune.FailureConfig(max_failures=0),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1)),
    )


@dataclasses.dataclass
class SweepSummary:
    run_dir: Path
    rows: int
    failed: int
    seconds: float
    report: Path | None


def _finish(cfg: Config, *, run_dir: Path, start: float, quiet: bool) -> SweepSummary:
    frame = results.read_results(run_dir)
    if cfg.audit.enabled and not cfg.audit.in_trial:
        from reports.audit import audit_run

        audit_run(run_dir, shadow_models=cfg.audit.shadow_models, seed=cfg.audit.seed)
        frame = results.read_results(run_dir)
    from reports.html import build_report

    report = build_report(run_dir)
    summary = SweepSummary(run_dir=run_dir, rows=len(frame),
                           failed=int((frame["status"] != "ok").sum()),
                           seconds=time.time() - start, report=report)
    if not quiet:
        print(f"sweep finished: {summary.rows} trials ({summary.failed} failed) in "
              f"{summary.seconds:.0f} s", flush=True)
    print(f"report: {report}", flush=True)
    return summary


def run_sweep(cfg: Config, *, run_dir: Path, address: str | None = None,
              quiet: bool = False) -> SweepSummary:
    """A new sweep into a new (or empty) RUN_DIR."""
    run_dir = Path(run_dir)
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UserInputError(field="--out", value=str(run_dir),
                             allowed="a new or empty directory (use `dpsweep resume` to "
                                     "continue a sweep)")
    spaces = spaces_for(cfg)
    load_data(cfg)  # bad data dirs fail here, before anything is written
    start = time.time()
    init_ray(address=address, quiet=quiet)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_storage(run_dir)
    (run_dir / CONFIG_FILE).write_text(cfg.to_toml())
    precompute(cfg, run_dir=run_dir, spaces=spaces, quiet=quiet)
    for index, (method, space) in enumerate(spaces.items()):
        _tuner(cfg, run_dir=run_dir, method=method, space=space, index=index,
               quiet=quiet).fit()
    return _finish(cfg, run_dir=run_dir, start=start, quiet=quiet)


def resume_sweep(run_dir: Path, *, address: str | None = None,
                 quiet: bool = False) -> SweepSummary:
    """Continue an interrupted sweep: finished trials are kept, unfinished ones resume."""
    from ray import tune

    run_dir = Path(run_dir)
    cfg = config_mod.load(run_dir / CONFIG_FILE) if (run_dir / CONFIG_FILE).is_file() else None
    if cfg is None:
        raise UserInputError(field="RUN_DIR", value=str(run_dir),
                             allowed=f"a sweep directory containing {CONFIG_FILE}")
    spaces = spaces_for(cfg)
    start = time.time()
    init_ray(address=address, quiet=quiet)
    check_storage(run_dir)
    for index, (method, space) in enumerate(spaces.items()):
        path = (run_dir / "tune" / method).resolve()
        if tune.Tuner.can_restore(str(path)):
            if not quiet:
                print(f"[{method}] resuming {path}", flush=True)
            tuner = tune.Tuner.restore(str(path), trainable=tune.with_resources(
                sweep_trainable, {"cpu": cfg.resources.cpus_per_trial,
                                  "gpu": cfg.resources.gpus_per_trial}),
                resume_unfinished=True, resume_errored=False, restart_errored=False)
        else:
            tuner = _tuner(cfg, run_dir=run_dir, method=method, space=space, index=index,
                           quiet=quiet)
        tuner.fit()
    return _finish(cfg, run_dir=run_dir, start=start, quiet=quiet)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use the dpsweep command")
