"""The ``dpsweep`` command line.

Every command validates all of its input before it writes anything; bad input ends with one
line ``dpsweep: error: FIELD = VALUE is not allowed: expected ...`` and exit code 2. The form of
every path argument is checked before the command runs (``orchestrator.config.paths``). A full disk
ends with one line saying what could not be written and how to go on (exit code 74), an
interrupt with one line and exit code 130: never a traceback. A sweep or re-audit in which a trial
or an audit failed ends with one line saying so and exit code 3. Every code is ``core.exits``'s.

Where each command's work lives (this module only parses, checks flags and prints; ``COMMANDS``
names the module, imported only when its command runs), under ``orchestrator``: budget ->
``cli_budget`` (``accounting.calibration``); run, resume, demo -> ``sweep.commands``
(``sweep.driver``); reaudit -> ``sweep.reaudit``; train -> ``trial.single``; report -> ``api``;
pick -> ``release.pick``; export -> ``release.export``; audit -> ``audit.canary``; config ->
``config`` (and ``trial.setup`` for --check). ``run`` and ``train`` read and validate their
CONFIG first (``CONFIG_FIRST``), so a bad one is refused before those modules load.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from dpsweep.core.errors import DiskFull, UserInputError, disk_full
from dpsweep.core.exits import EXIT_DISK_FULL, EXIT_SIGINT, EXIT_USAGE
from dpsweep.orchestrator import __version__, door
from dpsweep.orchestrator import config as config_mod
from dpsweep.orchestrator.config import DEFAULT_ACCOUNTANT_TIMEOUT_S
from dpsweep.orchestrator.config.checks import MAX_EPSILON
from dpsweep.orchestrator.config.paths import address_of, check_address_form, check_path_form
from dpsweep.orchestrator.sweep.signals import ignore_further_signals

#: Path arguments (argparse dest -> the name the user typed, and whether dpsweep creates it),
#: checked in form before any command.
PATH_ARGS = {"out": ("--out", True), "run_dir": ("RUN_DIR", False), "config": ("CONFIG", False),
             "check": ("CONFIG", False), "export": ("--export", True)}
#: The module each command's work lives in, imported only when that command runs (its handler
#: here, ``cmd_<command>``, is given it): ``--help``, ``config``, ``budget`` and the other
#: commands that train nothing never import torch, Ray or Optuna through another command.
COMMANDS = {verb: f"dpsweep.orchestrator.{module}" for verb, module in (
    ("budget", "cli_budget"), ("run", "sweep.commands"), ("resume", "sweep.commands"),
    ("demo", "sweep.commands"), ("reaudit", "sweep.reaudit"), ("train", "trial.single"),
    ("report", "api"), ("pick", "release.pick"), ("export", "release.export"),
    ("audit", "audit.canary"), ("config", "trial.setup"))}
#: Commands whose CONFIG is read and validated before their module is imported (into
#: ``args.cfg``): a missing, unparsable or invalid config is refused in about a second, as by
#: ``config --check``, not after the 10-20 s that torch, Ray and Optuna take to load.
CONFIG_FIRST = ("run", "train")


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in the same one-line form as everything else."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def cmd_budget(args: argparse.Namespace, budget: ModuleType) -> int:
    return int(budget.run(args))


def _print_trial(result: Any, out: Path) -> None:
    p = result.privacy_record
    print(f"\n{'epoch':>5} {'val_acc':>8} {'test_acc':>8} {'train_loss*':>11} {'eps_spent':>9} "
          f"{'sec':>6}")
    for m in result.history:
        test = f"{m['test_accuracy']:>8.4f}" if "test_accuracy" in m else f"{'-':>8}"
        print(f"{m['epoch']:>5} {m['val_accuracy']:>8.4f} {test} "
              f"{m['train_loss_nonprivate']:>11.4f} {m['epsilon_spent']:>9.3f} "
              f"{m['epoch_seconds']:>6.2f}")
    print("* computed on private data without noise: not covered by epsilon, never exported")
    print(f"\nmethod {p.method} (mode {p.mode})  validation accuracy "
          f"{result.val_accuracy:.4f}  test accuracy {result.test_accuracy:.4f}")
    print(f"epsilon <= {_up(p.epsilon_upper)} (target {p.target_epsilon:g}, "
          f"delta {p.delta:g}, accountant {p.accountant}), sigma "
          f"{_up(p.noise_multiplier)}, q {p.sample_rate:.5g}, steps {p.steps}")
    validity = "valid" if p.dp_valid else p.validity_reason
    release = "" if p.release_safe else "; REPLAYABLE (reproducible = true): not releasable"
    print(f"epsilon claim: {validity}{release}")
    print(f"wall time {result.seconds:.1f} s; run directory {out}")


def _up(value: float) -> str:
    """A privacy number rounded up at 4 decimals (rounding down would understate it)."""
    return f"{math.ceil(value * 1e4) / 1e4:.4f}"


def cmd_train(args: argparse.Namespace, single: ModuleType) -> int:
    cfg = args.setup.config
    out = Path(args.out)

    def progress(m: dict[str, Any]) -> None:
        print(f"  epoch {m['epoch']:>3}/{cfg.training.epochs}: val acc {m['val_accuracy']:.4f}, "
              f"eps spent {m['epsilon_spent']:.3f}", flush=True)

    _print_trial(single.train_single(args.setup, out=out, progress=progress), out)
    return 0


def cmd_demo(args: argparse.Namespace, sweep: ModuleType) -> int:
    return int(sweep.demo(args))


def cmd_run(args: argparse.Namespace, sweep: ModuleType) -> int:
    return int(sweep.run(args, setup=args.setup))


def cmd_resume(args: argparse.Namespace, sweep: ModuleType) -> int:
    return int(sweep.resume(args))


def cmd_reaudit(args: argparse.Namespace, reaudit: ModuleType) -> int:
    return int(reaudit.reaudit(args))


def cmd_report(args: argparse.Namespace, api: ModuleType) -> int:
    print(f"report: {api.report(args.run_dir)}")
    return 0


def cmd_pick(args: argparse.Namespace, pick: ModuleType) -> int:
    for name, value in (("--max-peak-mia", args.max_peak_mia),
                        ("--min-val-acc", args.min_val_acc)):
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise UserInputError(field=name, value=value, allowed="a number in [0, 1]")
    print(pick.pick_and_write(Path(args.run_dir), max_peak_mia=args.max_peak_mia,
                              min_val_acc=args.min_val_acc, series=args.series,
                              allow_invalid_dp=args.allow_invalid_dp,
                              allow_replayable=args.allow_replayable,
                              export_to=Path(args.export) if args.export else None,
                              allow_degenerate=args.allow_degenerate))
    return 0


def cmd_export(args: argparse.Namespace, export: ModuleType) -> int:
    result = export.export_from_run(Path(args.run_dir), trial_id=args.trial, out=Path(args.out),
                                    allow_replayable=args.allow_replayable,
                                    allow_invalid_dp=args.allow_invalid_dp,
                                    allow_degenerate=args.allow_degenerate)
    print(result.summary())
    return 0


def cmd_audit(args: argparse.Namespace, canary: ModuleType) -> int:
    result = canary.audit_with_canaries(Path(args.run_dir), trial_id=args.trial,
                                        canaries=args.canaries, white_box=args.white_box,
                                        quiet=args.quiet)
    print(result.summary())
    return 0


def cmd_config(args: argparse.Namespace, setup: ModuleType) -> int:
    if args.method:
        print(setup.describe_method(args.method))
        return 0
    if args.check:
        # every rule `run` checks before Ray starts, the resources against this machine (on a
        # cluster, `run --address` checks them against its nodes once connected)
        checked = door.check_file(args.check, data=True)
        where = checked.data_location
        print(f"{args.check}: valid; {checked.config.data.dataset} data: {where}")
        if checked.left_out_line():
            print(checked.left_out_line())
        if args.estimate:
            from dpsweep.orchestrator.sweep.estimate import estimate

            print("\n".join(estimate(checked).lines()), flush=True)
        return 0
    print(config_mod.describe())
    return 0


def _add_budget(sub: Any) -> None:
    """``dpsweep budget``'s arguments."""
    b = sub.add_parser("budget", help="noise multiplier for a privacy budget (PRV accountant)")
    b.add_argument("--epsilon", type=float, required=True,
                   help=f"target epsilon (privacy.epsilon), in (0, {MAX_EPSILON:g}]")
    b.add_argument("--delta", type=float, required=True, help="target delta (privacy.delta)")
    b.add_argument("--sample-rate", type=float, help="Poisson sampling rate q")
    b.add_argument("--batch-size", type=int,
                   help="expected batch size (training.batch_size; with --train-size)")
    b.add_argument("--train-size", type=int,
                   help="private training examples N (data.train_size)")
    b.add_argument("--steps", type=int, help="number of steps")
    b.add_argument("--epochs", type=int, help="number of epochs (training.epochs; 1/q steps each)")
    b.add_argument("--accountant-timeout-s", type=float,
                   help="seconds before falling back to RDP (privacy.accountant_timeout_s, "
                        f"default {DEFAULT_ACCOUNTANT_TIMEOUT_S:g})")
    b.add_argument("--json", action="store_true", help="print the full calibration as JSON")
    b.set_defaults(func=cmd_budget)


def _add_run(sub: Any) -> None:
    """``dpsweep run``'s arguments."""
    r = sub.add_parser("run", help="sweep: train, match budgets, tune, audit, report")
    r.add_argument("config", help="CONFIG.toml")
    r.add_argument("--out", help="new run directory (default runs/CONFIG-TIMESTAMP)")
    r.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or local Ray)")
    r.add_argument("--quiet", action="store_true", help="no progress output (for CI)")
    r.add_argument("--estimate", action="store_true",
                   help="time a few real steps of each method and print the sweep's projected "
                        "cost (steps, audit, wall time, memory); runs no sweep, keeps nothing")
    r.set_defaults(func=cmd_run)


def _add_resume(sub: Any) -> None:
    """``dpsweep resume``'s arguments."""
    rs = sub.add_parser("resume", help="continue an interrupted sweep; finished trials kept")
    rs.add_argument("run_dir", help="RUN_DIR of the sweep")
    rs.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or local Ray)")
    rs.add_argument("--quiet", action="store_true", help="no progress output (for CI)")
    rs.add_argument("--retry-failed", action="store_true",
                    help="train failed trials and re-runs again, with their own "
                         "hyperparameters (not with sweep.tuning = 'private')")
    rs.set_defaults(func=cmd_resume)


def _add_reaudit(sub: Any) -> None:
    """``dpsweep reaudit``'s arguments."""
    ra = sub.add_parser(
        "reaudit", help="run the membership audit again, without training, for finished "
                        "trials whose audit failed or is missing",
        description="Verify RUN_DIR as resume does (a changed file, a checkpoint included, is "
                    "refused: exit 2, nothing written), audit each chosen trial from its stored "
                    "checkpoint on Ray, record the results and rebuild the report. An audit "
                    "that stands is never run again. Exit 3 when an audit fails again.")
    ra.add_argument("run_dir", help="RUN_DIR of the sweep")
    which = ra.add_mutually_exclusive_group()
    which.add_argument("--trial", action="append", metavar="ID",
                       help="only this trial (repeatable); default: every finished trial the "
                            "sweep's audit covers whose audit failed or is missing")
    which.add_argument("--all", action="store_true",
                       help="every finished trial without an audit, also outside the audit's "
                            "scope (audit.scope = 'front')")
    ra.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or local Ray)")
    ra.add_argument("--quiet", action="store_true", help="no progress output (for CI)")
    ra.set_defaults(func=cmd_reaudit)


def _add_report(sub: Any) -> None:
    """``dpsweep report``'s arguments."""
    rp = sub.add_parser("report", help="(re)build the report from stored results only")
    rp.add_argument("run_dir", help="RUN_DIR")
    rp.set_defaults(func=cmd_report)


def _add_pick(sub: Any) -> None:
    """``dpsweep pick``'s arguments."""
    pk = sub.add_parser("pick", help="the deployable trial from the Pareto front (private "
                                     "tuning: the best noisy validation score)")
    pk.add_argument("run_dir", help="RUN_DIR")
    pk.add_argument("--max-peak-mia", type=float,
                    help="largest acceptable upper confidence bound of the peak MIA accuracy")
    pk.add_argument("--min-val-acc", type=float, help="smallest acceptable validation accuracy")
    pk.add_argument("--series", help="only this series' trials ('method' or 'method:mode')")
    pk.add_argument("--allow-invalid-dp", action="store_true",
                    help="also consider trials whose epsilon claim is invalid (faithful modes)")
    pk.add_argument("--allow-replayable", action="store_true",
                    help="also consider reproducible trials (seeded noise: not releasable)")
    pk.add_argument("--export", metavar="DIR", help="also export the picked trial's release")
    pk.add_argument("--allow-degenerate", action="store_true",
                    help="with --export: export the picked trial even at chance level (private "
                         "tuning picks by the noisy score alone)")
    pk.set_defaults(func=cmd_pick)


def _add_export(sub: Any) -> None:
    """``dpsweep export``'s arguments."""
    ex = sub.add_parser("export", help="write a trial's release: weights, code, loader and "
                                       "privacy statement")
    ex.add_argument("run_dir", help="RUN_DIR")
    ex.add_argument("--trial", required=True, help="trial id")
    ex.add_argument("--out", required=True, help="new directory for the release")
    ex.add_argument("--allow-replayable", action="store_true",
                    help="export a reproducible (seeded, replayable) trial anyway")
    ex.add_argument("--allow-invalid-dp", action="store_true",
                    help="export a trial whose epsilon claim is invalid anyway")
    ex.add_argument("--allow-degenerate", action="store_true",
                    help="export a degenerate trial (at chance level) anyway")
    ex.set_defaults(func=cmd_export)


def _add_audit(sub: Any) -> None:
    """``dpsweep audit``'s arguments."""
    au = sub.add_parser("audit", help="canary audit of a trial: an empirical epsilon lower bound")
    au.add_argument("run_dir", help="RUN_DIR")
    au.add_argument("--trial", required=True, help="trial id")
    au.add_argument("--canaries", type=int, default=None,
                    help="canaries m (default 1000 white-box; black-box at most the holdout size)")
    au.add_argument("--white-box", action="store_true",
                    help="gradient canaries scored by the released updates (else input canaries "
                         "scored by loss)")
    au.add_argument("--quiet", action="store_true", help="no progress output")
    au.set_defaults(func=cmd_audit)


def _add_train(sub: Any) -> None:
    """``dpsweep train``'s arguments."""
    t = sub.add_parser("train", help="train one trial from a config (no sweep)")
    t.add_argument("config", help="CONFIG.toml")
    t.add_argument("--out", required=True, help="new run directory")
    t.set_defaults(func=cmd_train)


def _add_demo(sub: Any) -> None:
    """``dpsweep demo``'s arguments."""
    d = sub.add_parser("demo", help="the embedded default: a small offline sweep + report")
    d.add_argument("--out", help="output directory (default runs/demo-TIMESTAMP)")
    d.add_argument("--quiet", action="store_true", help="no progress output")
    d.set_defaults(func=cmd_demo)


def _add_config(sub: Any) -> None:
    """``dpsweep config``'s arguments."""
    c = sub.add_parser("config", help="print every config key with its default and meaning")
    c.add_argument("--check", metavar="CONFIG",
                   help="validate a config file (its data available, its resources on this "
                        "machine) and exit")
    c.add_argument("--method", help="print one method's hyperparameter table")
    c.add_argument("--estimate", action="store_true",
                   help="with --check: time a few real steps of each method and print the "
                        "sweep's projected wall time and peak memory (as `run --estimate`)")
    c.set_defaults(func=cmd_config)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dpsweep", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"dpsweep {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_budget, _add_run, _add_resume, _add_reaudit, _add_report, _add_pick,
                _add_export, _add_audit, _add_train, _add_demo, _add_config):
        add(sub)
    return p


def _check_path_forms(args: argparse.Namespace) -> None:
    """Every path argument given is usable in form (``orchestrator.config.paths``), and a given
    --address is not empty, before any command."""
    for dest, (flag, creates) in PATH_ARGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            check_path_form(value, field=flag, creates=creates)
    check_address_form(getattr(args, "address", None))


def disk_full_line(args: argparse.Namespace, exc: BaseException, full: DiskFull) -> str:
    """One line: what could not be written, that the disk is full, and how to go on (a sweep's
    run directory is left consistent, so it resumes)."""
    sweep = (getattr(exc, "run_dir", None) or getattr(args, "sweep_dir", None)
             or getattr(args, "run_dir", None))
    if args.command in ("run", "demo", "resume") and sweep is not None:
        then = f"free some space, then continue with `dpsweep resume {sweep}`"
    else:
        then = "free some space, then run the command again"
    return f"dpsweep: error: could not write {full.what}: the disk is full; {then}"


#: What writing into a directory the user may not write raises (root on a read-only mount).
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def not_writable_line(args: argparse.Namespace, exc: BaseException) -> str | None:
    """One line for a file that could not be written for want of permission or a read-only
    file system (``resume`` taking the run's lock, ``report`` writing RUN_DIR/report): the
    directory the user named that holds the file (RUN_DIR, --out or --export) and the file;
    None for anything else."""
    if not isinstance(exc, OSError) or exc.errno not in NOT_WRITABLE:
        return None
    target = os.fsdecode(exc.filename) if exc.filename is not None else None
    named = [(flag, str(value)) for flag, value in (
        ("RUN_DIR", getattr(args, "run_dir", None)),
        ("--out", getattr(args, "sweep_dir", None) or getattr(args, "out", None)),
        ("--export", getattr(args, "export", None))) if value is not None]
    inside = [(flag, value) for flag, value in named if target is not None
              and Path(os.path.abspath(target)).is_relative_to(os.path.abspath(value))]
    field, value = (inside or named or [("file", target)])[0]
    what = "a writable run directory" if field == "RUN_DIR" else "a location you can write"
    if field == "RUN_DIR" and args.command == "report":
        what += " (`dpsweep report` writes RUN_DIR/report: copy the run somewhere writable)"
    where = f"{target}: " if target else ""
    return (f"dpsweep: error: {field} = {value!r} is not allowed: expected {what}; it is not "
            f"writable ({where}{exc.strerror or exc})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_path_forms(args)
        if args.command in CONFIG_FIRST:
            args.setup = door.check_file(args.config,
                                         machine=not address_of(getattr(args, "address", None)))
        return int(args.func(args, importlib.import_module(COMMANDS[args.command])) or 0)
    except UserInputError as exc:
        sys.stderr.write(f"dpsweep: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:  # CalibrationInterrupted included: never an RDP fallback
        ignore_further_signals()
        sys.stderr.write("dpsweep: interrupted\n")
        return EXIT_SIGINT
    except BaseException as exc:  # a sweep's stop on a full disk may be a BaseException too
        line = not_writable_line(args, exc)
        if line is not None:
            sys.stderr.write(line + "\n")
            return EXIT_USAGE
        full = disk_full(exc)
        if full is None:
            raise
        sys.stderr.write(disk_full_line(args, exc, full) + "\n")
        return EXIT_DISK_FULL


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
