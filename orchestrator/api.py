"""dpsweep's Python API: what the command line does, as functions.

    from dpsweep.orchestrator import api

    cfg = api.load_config("sweep.toml")            # or api.Config() with dataclasses.replace
    summary = api.run(cfg, out="runs/sweep1")      # Ray Tune + Optuna, audit, report
    summary.exit_code                              # 3 when a trial or an audit failed
    api.reaudit("runs/sweep1")                     # failed or missing audits, no training
    frame = api.results("runs/sweep1")             # pandas DataFrame, one row per trial
    text = api.pick("runs/sweep1", max_peak_mia=0.6)
    release = api.export("runs/sweep1", trial_id="dpsgd_eps3-001", out="release")

Every function validates its input first, through the same door as the command line
(``orchestrator.door.check``: the same rules in the same order, the same message), and raises
:class:`UserInputError` (one message naming the field, the value and what is allowed) on bad
input; files in a run directory are verified against its manifest before they are read.

``run``, ``resume`` and ``reaudit`` import the sweep (Ray, Optuna) and ``pick`` and ``export``
the release code (torch) only when they are called: ``dpsweep report`` imports this module and
needs none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpsweep.core.errors import UserInputError
from dpsweep.core.layout import RESULTS
from dpsweep.orchestrator import cli_budget
from dpsweep.orchestrator.config import Config, parse, read_toml
from dpsweep.orchestrator.config.paths import address_of, check_address_form, check_path_form
from dpsweep.orchestrator.door import CheckedSetup, check
from dpsweep.orchestrator.release.selection import read_selection
from dpsweep.orchestrator.report import run_report
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.reports.store import read_results
from dpsweep.trainables.models.source import source_of_callable

if TYPE_CHECKING:
    import pandas as pd

    from dpsweep.core.trial import Calibration
    from dpsweep.orchestrator.release.bundle import ExportResult
    from dpsweep.orchestrator.sweep.driver import SweepSummary
    from dpsweep.orchestrator.sweep.reaudit import ReauditSummary

__all__ = ["Config", "UserInputError", "budget", "export", "from_dict", "load_config", "pick",
           "reaudit", "report", "results", "resume", "run"]


def load_config(path: str | Path, *, model: Callable[..., Any] | None = None,
                machine: bool = True) -> Config:
    """A config from a TOML file (``dpsweep config`` lists every key) checked as ``dpsweep
    config --check`` checks it (its data on this machine, too); ``model`` is your network's
    factory as a callable (see :func:`run`), set before the checks. ``machine=False`` leaves
    out the resources against this machine (a config for a cluster, written on a laptop)."""
    return from_dict(read_toml(path), base_dir=Path(path).resolve().parent, model=model,
                     machine=machine)


def from_dict(raw: Mapping[str, Any], *, base_dir: str | Path | None = None,
              model: Callable[..., Any] | None = None, machine: bool = True) -> Config:
    """A checked config from a dict shaped like the TOML file; ``model`` and ``machine`` as in
    :func:`load_config`."""
    cfg = parse(raw if model is None else _with_model(raw, model), base_dir=base_dir)
    return check(cfg, machine=machine, data=True).config


def run(cfg: Config, *, out: str | Path, address: str | None = None, quiet: bool = False,
        model: Callable[..., Any] | None = None) -> SweepSummary:
    """Run a sweep into the new directory ``out`` (local Ray on loopback, or ``address``),
    showing its progress as ``dpsweep run`` does (``quiet=True``: nothing, as ``--quiet``).

    ``model`` is your network's factory, called as ``model(input_shape=..., num_classes=...,
    **cfg.model.args)``; it must be defined at the top level of a module file, since workers,
    ``resume`` and ``export`` import it by name (its folder ships to every worker).
    """
    run_dir = check_path_form(out, field="out")
    setup = _checked(cfg, model=model, machine=not address_of(address, field="address"))
    from dpsweep.orchestrator.sweep.driver import run_sweep

    return run_sweep(setup, run_dir=run_dir, address=address, quiet=quiet)


def _checked(cfg: Config, *, model: Callable[..., Any] | None, machine: bool) -> CheckedSetup:
    """``cfg`` through the door: a ``Config`` changed with ``dataclasses.replace`` (or built
    field by field) has met none of the rules, not even each field's own."""
    if not isinstance(cfg, Config):
        raise UserInputError(field="cfg", value=type(cfg).__name__,
                             allowed="an api.Config (api.load_config, api.from_dict, or "
                                     "api.Config() changed with dataclasses.replace)")
    raw = cfg.to_dict()
    return check(parse(raw if model is None else _with_model(raw, model)), machine=machine)


def _with_model(raw: Mapping[str, Any], model: Callable[..., Any]) -> dict[str, Any]:
    """``raw`` with ``[model] factory`` and ``code_dir`` naming the callable ``model``."""
    section = dict(raw.get("model") or {})
    source = source_of_callable(model, args=section.get("args"),
                                layers=tuple(section.get("layers") or ()))
    return {**raw, "model": {**section, "factory": source.factory,
                             "code_dir": source.code_dir}}


def resume(run_dir: str | Path, *, address: str | None = None, quiet: bool = False,
           retry_failed: bool = False) -> SweepSummary:
    """Continue an interrupted sweep; finished trials are kept (``retry_failed``: failed
    trials and re-runs are trained again; refused under private tuning)."""
    from dpsweep.orchestrator.sweep.driver import resume_sweep

    check_address_form(address, field="address")
    return resume_sweep(Path(run_dir), address=address, quiet=quiet, retry_failed=retry_failed)


def reaudit(run_dir: str | Path, *, trials: Sequence[str] = (), every: bool = False,
            address: str | None = None, quiet: bool = False) -> ReauditSummary:
    """Run the membership audit again, without training, for the finished trials whose audit
    failed or is missing (``dpsweep reaudit``): those the sweep's audit covers, or ``trials``,
    or with ``every`` every finished trial without an audit. An audit that stands is never run
    again; the report is rebuilt."""
    from dpsweep.orchestrator.sweep.reaudit import reaudit_run

    check_address_form(address, field="address")
    return reaudit_run(Path(run_dir), trials=tuple(trials), every=every, address=address,
                       quiet=quiet)


def results(run_dir: str | Path) -> pd.DataFrame:
    """The verified results store (columns: ``reports.store.COLUMNS``; docs/results.md)."""
    run = RunDir.open(Path(run_dir), write=False)
    run.verify(RESULTS)
    return read_results(run.path)


def report(run_dir: str | Path) -> Path:
    """(Re)build the HTML report from the stored results, once every listed file is unchanged
    and the records of how the run selects agree (``orchestrator.release.selection``); returns
    its path."""
    run = RunDir.open(Path(run_dir), write=False)
    run.verify_all()
    read_selection(run, frame=read_results(run.path, allow_empty=True), release=False)
    return run_report(Path(run_dir))


def pick(run_dir: str | Path, *, max_peak_mia: float | None = None,
         min_val_acc: float | None = None, series: str | None = None,
         allow_invalid_dp: bool = False, allow_replayable: bool = False,
         export_to: str | Path | None = None, allow_degenerate: bool = False) -> str:
    """Choose the deployable trial (writes pick.toml); returns the text ``dpsweep pick`` prints.
    ``allow_degenerate`` lets ``export_to`` release a trial at chance level (private tuning
    picks by the noisy score alone, which can choose one)."""
    from dpsweep.orchestrator.release.pick import pick_and_write

    if export_to is not None:
        check_path_form(export_to, field="export_to")
    return pick_and_write(Path(run_dir), max_peak_mia=max_peak_mia, min_val_acc=min_val_acc,
                          series=series, allow_invalid_dp=allow_invalid_dp,
                          allow_replayable=allow_replayable,
                          export_to=None if export_to is None else Path(export_to),
                          allow_degenerate=allow_degenerate)


def export(run_dir: str | Path, *, trial_id: str, out: str | Path,
           allow_replayable: bool = False, allow_invalid_dp: bool = False,
           allow_degenerate: bool = False) -> ExportResult:
    """Write the trial's release into ``out``: weights, model description, the network's code
    and a loader (``docs/export.md``), and the privacy statement. A degenerate trial (at
    chance level) is refused unless ``allow_degenerate``."""
    from dpsweep.orchestrator.release.export import export_from_run

    return export_from_run(Path(run_dir), trial_id=trial_id,
                           out=check_path_form(out, field="out"),
                           allow_replayable=allow_replayable, allow_invalid_dp=allow_invalid_dp,
                           allow_degenerate=allow_degenerate)


def budget(*, epsilon: float, delta: float, sample_rate: float | None = None,
           batch_size: int | None = None, train_size: int | None = None,
           steps: int | None = None, epochs: int | None = None,
           accountant_timeout_s: float | None = None) -> Calibration:
    """The calibrated noise for a privacy budget (``dpsweep budget``): ``sample_rate``, or
    ``batch_size`` with ``train_size``; ``steps``, or ``epochs``. Its ``noise_multiplier`` is
    rounded up and certified by the PRV accountant (or RDP, when PRV runs out of time)."""
    return cli_budget.budget(epsilon=epsilon, delta=delta, sample_rate=sample_rate,
                             batch_size=batch_size, train_size=train_size, steps=steps,
                             epochs=epochs, accountant_timeout_s=accountant_timeout_s)[0]
