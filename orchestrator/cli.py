"""The ``dpsweep`` command line.

Every command validates all of its input before it writes anything; bad input ends with one
line ``dpsweep: error: FIELD = VALUE is not allowed: expected ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from core.errors import UserInputError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in the same one-line form as everything else."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def _positive(name: str, value: float, *, upper: float | None = None,
              upper_open: bool = False) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserInputError(field=name, value=value, allowed="a finite number > 0")
    if upper is not None and (value > upper or (upper_open and value >= upper)):
        raise UserInputError(field=name, value=value,
                             allowed=f"a number in (0, {upper}{')' if upper_open else ']'}")


def cmd_budget(args: argparse.Namespace) -> int:
    from orchestrator.budget import calibrate
    from trainables.training import poisson_plan

    _positive("--epsilon", args.epsilon)
    _positive("--delta", args.delta, upper=1.0, upper_open=True)
    if args.sample_rate is not None:
        if args.batch_size is not None or args.dataset_size is not None:
            raise UserInputError(field="--sample-rate", value=args.sample_rate,
                                 allowed="either --sample-rate or --batch-size with "
                                         "--dataset-size, not both")
        _positive("--sample-rate", args.sample_rate, upper=1.0)
        q = args.sample_rate
        steps_per_epoch = max(1, round(1.0 / q))
    else:
        if args.batch_size is None or args.dataset_size is None:
            raise UserInputError(field="--batch-size/--dataset-size",
                                 value=(args.batch_size, args.dataset_size),
                                 allowed="both given (or --sample-rate instead)")
        if args.dataset_size < 1:
            raise UserInputError(field="--dataset-size", value=args.dataset_size,
                                 allowed="an integer >= 1")
        if not 1 <= args.batch_size <= args.dataset_size:
            raise UserInputError(field="--batch-size", value=args.batch_size,
                                 allowed=f"an integer in [1, --dataset-size={args.dataset_size}]")
        q, steps_per_epoch = poisson_plan(dataset_size=args.dataset_size,
                                          batch_size=args.batch_size)
    if (args.steps is None) == (args.epochs is None):
        raise UserInputError(field="--steps/--epochs", value=(args.steps, args.epochs),
                             allowed="exactly one of them")
    if args.steps is not None and args.steps < 1:
        raise UserInputError(field="--steps", value=args.steps, allowed="an integer >= 1")
    if args.epochs is not None and args.epochs < 1:
        raise UserInputError(field="--epochs", value=args.epochs, allowed="an integer >= 1")
    if args.dataset_size is not None and args.delta >= 1.0 / args.dataset_size:
        raise UserInputError(field="--delta", value=args.delta,
                             allowed=f"< 1/--dataset-size = {1.0 / args.dataset_size:.3g}")
    steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch
    cal = calibrate(target_epsilon=args.epsilon, delta=args.delta, sample_rate=q, steps=steps,
                    timeout_s=args.timeout)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=2))
        return 0
    b = cal.bounds
    fmt = (lambda v: "n/a" if v is None else f"{v:.4f}")  # noqa: E731
    print(f"sigma (noise multiplier): {cal.noise_multiplier:.4f}")
    print(f"sample rate q:            {q:.6g}")
    print(f"steps:                    {steps}")
    print(f"delta:                    {args.delta:g}")
    print(f"epsilon lower:            {fmt(b.lower)}")
    print(f"epsilon estimate:         {fmt(b.estimate)}")
    print(f"epsilon upper:            {fmt(b.upper)}   (target {args.epsilon:g})")
    print(f"accountant:               {cal.accountant}"
          + (f"  (fallback: {cal.fallback_reason})" if cal.fallback_reason else "")
          + ("  [cached]" if cal.cached else ""))
    return 0


def _new_out_dir(path: Path) -> Path:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserInputError(field="--out", value=str(path),
                             allowed="a new or empty directory (refusing to overwrite)")
    return path


def _print_trial(result: Any, out: Path) -> None:
    p = result.privacy
    print(f"\n{'epoch':>5} {'train_loss':>10} {'test_acc':>8} {'eps_spent':>9} {'sec':>6}")
    for m in result.history:
        print(f"{m['epoch']:>5} {m['train_loss']:>10.4f} {m['test_accuracy']:>8.4f} "
              f"{m['epsilon_spent']:>9.3f} {m['epoch_seconds']:>6.2f}")
    print(f"\nmethod {p['method']}  test accuracy {result.test_accuracy:.4f}")
    print(f"epsilon upper {p['epsilon_upper']:.4f} (target {p['target_epsilon']:g}, "
          f"delta {p['delta']:g}, accountant {p['accountant']}), sigma {p['noise_multiplier']:.4f},"
          f" q {p['sample_rate']:.5g}, steps {p['steps']}, dp_valid {p['dp_valid']}")
    print(f"wall time {result.seconds:.1f} s; results in {out}")


def _train_config(cfg: Any, out: Path) -> Any:
    from orchestrator.trial import load_data, plan_trial
    from trainables.training import train_trial

    data = load_data(cfg)  # validates data_dir and files before anything is written
    spec = plan_trial(cfg, data=data)
    cal = spec.calibration
    print(f"budget: sigma {cal['schedule'][0]['noise_multiplier']:.4f} for epsilon "
          f"{cal['target_epsilon']:g}, delta {cal['delta']:g}, q {cal['sample_rate']:.5g}, "
          f"{sum(p['steps'] for p in cal['schedule'])} steps "
          f"(upper epsilon {cal['bounds']['upper']:.4f}, {cal['accountant']})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(cfg.to_toml())
    (out / "budget.json").write_text(json.dumps(cal, indent=2))

    def progress(metrics: dict[str, Any], _ckpt: Path | None) -> None:
        print(f"  epoch {metrics['epoch']:>3}/{spec.epochs}: test acc "
              f"{metrics['test_accuracy']:.4f}, eps spent {metrics['epsilon_spent']:.3f}",
              flush=True)

    result = train_trial(spec, data=data, checkpoint_root=out / "checkpoints", report=progress)
    _print_trial(result, out)
    return result


def cmd_train(args: argparse.Namespace) -> int:
    from orchestrator import config as config_mod

    cfg = config_mod.load(args.config)
    out = _new_out_dir(Path(args.out))
    _train_config(cfg, out)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from orchestrator.config import Config
    from orchestrator.sweep import run_sweep

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = _new_out_dir(Path(args.out) if args.out else Path("runs") / f"demo-{stamp}")
    cfg = Config()
    cfg = dataclasses.replace(cfg, sweep=dataclasses.replace(cfg.sweep, trials_per_method=3))
    print("dpsweep demo: sweep of all five DP methods on the bundled digits data (offline), "
          f"3 trials each at epsilon {cfg.privacy.epsilon:g}, per-layer MIA audit, report",
          flush=True)
    run_sweep(cfg, run_dir=out, quiet=args.quiet)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from orchestrator import config as config_mod
    from orchestrator.sweep import run_sweep

    cfg = config_mod.load(args.config)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("runs") / f"{Path(args.config).stem}-{stamp}"
    _new_out_dir(out)
    run_sweep(cfg, run_dir=out, address=args.address, quiet=args.quiet)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from orchestrator.sweep import resume_sweep

    resume_sweep(Path(args.run_dir), address=args.address, quiet=args.quiet)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from reports.html import build_report

    print(f"report: {build_report(Path(args.run_dir))}")
    return 0


def cmd_pick(args: argparse.Namespace) -> int:
    from reports.pick import format_pick, pick

    for name, value in (("--max-peak-mia", args.max_peak_mia),
                        ("--min-test-acc", args.min_test_acc)):
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise UserInputError(field=name, value=value, allowed="a number in [0, 1]")
    result = pick(Path(args.run_dir), max_peak_mia=args.max_peak_mia,
                  min_test_acc=args.min_test_acc, method=args.method,
                  allow_invalid_dp=args.allow_invalid_dp)
    print(format_pick(result))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from orchestrator import config as config_mod

    if args.check:
        config_mod.load(args.check)
        print(f"{args.check}: valid")
        return 0
    print(config_mod.describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dpsweep", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    b = sub.add_parser("budget", help="noise multiplier for a privacy budget (PRV accountant)")
    b.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    b.add_argument("--delta", type=float, required=True, help="target delta")
    b.add_argument("--sample-rate", type=float, help="Poisson sampling rate q")
    b.add_argument("--batch-size", type=int, help="expected batch size (with --dataset-size)")
    b.add_argument("--dataset-size", type=int, help="training set size N")
    b.add_argument("--steps", type=int, help="number of steps")
    b.add_argument("--epochs", type=int, help="number of epochs (1/q steps each)")
    b.add_argument("--timeout", type=float, default=120.0,
                   help="seconds before falling back to RDP (default 120)")
    b.add_argument("--json", action="store_true", help="print the full calibration as JSON")
    b.set_defaults(func=cmd_budget)

    r = sub.add_parser("run", help="sweep: train, match budgets, tune, audit, report")
    r.add_argument("config", help="CONFIG.toml")
    r.add_argument("--out", help="new run directory (default runs/CONFIG-TIMESTAMP)")
    r.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or local Ray)")
    r.add_argument("--quiet", action="store_true", help="no progress lines (for CI)")
    r.set_defaults(func=cmd_run)

    rs = sub.add_parser("resume", help="continue an interrupted sweep; finished trials kept")
    rs.add_argument("run_dir", help="RUN_DIR of the sweep")
    rs.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or local Ray)")
    rs.add_argument("--quiet", action="store_true", help="no progress lines (for CI)")
    rs.set_defaults(func=cmd_resume)

    rp = sub.add_parser("report", help="(re)build the report from stored results only")
    rp.add_argument("run_dir", help="RUN_DIR")
    rp.set_defaults(func=cmd_report)

    pk = sub.add_parser("pick", help="deployable config + checkpoint from the Pareto front")
    pk.add_argument("run_dir", help="RUN_DIR")
    pk.add_argument("--max-peak-mia", type=float, help="largest acceptable peak-layer MIA acc.")
    pk.add_argument("--min-test-acc", type=float, help="smallest acceptable test accuracy")
    pk.add_argument("--method", help="only this method's trials")
    pk.add_argument("--allow-invalid-dp", action="store_true",
                    help="also consider trials whose epsilon claim is invalid (faithful modes)")
    pk.set_defaults(func=cmd_pick)

    t = sub.add_parser("train", help="train one trial from a config (no sweep)")
    t.add_argument("config", help="CONFIG.toml")
    t.add_argument("--out", required=True, help="new output directory")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("demo", help="the embedded default: a small offline sweep + report")
    d.add_argument("--out", help="output directory (default runs/demo-TIMESTAMP)")
    d.add_argument("--quiet", action="store_true", help="no progress lines")
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("config", help="print every config key with its default and meaning")
    c.add_argument("--check", metavar="CONFIG", help="validate a config file and exit")
    c.set_defaults(func=cmd_config)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserInputError as exc:
        sys.stderr.write(f"dpsweep: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("dpsweep: interrupted\n")
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
