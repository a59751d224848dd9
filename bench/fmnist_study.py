"""Summarise a Fashion-MNIST study run into the README's table; combine the full-size parts.

    make data && .venv/bin/dpsweep run configs/fmnist.toml --out runs/fmnist
    .venv/bin/python -m bench.fmnist_study runs/fmnist
    # the full-size study, one part per sitting (configs/fmnist_full_[abcd].toml):
    .venv/bin/dpsweep run configs/fmnist_full_a.toml --out runs/fmnist_full_a
    .venv/bin/python -m bench.fmnist_study runs/fmnist_full_a --name fmnist_full_a
    .venv/bin/python -m bench.fmnist_study --combine fmnist_full_a fmnist_full_b ... \
        --name fmnist_full

Per series and epsilon: the tuned configuration (the study's best validation trial) and its
re-runs with fresh noise (``sweep.seeds``) give mean ± sd of validation and test accuracy over
seeds; the audited front trial gives the peak MIA with its simultaneous upper bound, the layer
and attack of the peak, whether a leak was detected, and every measured ROC point checked against
the claimed epsilon (``orchestrator.audit.membership.claim_check``); the study's trials, how many
the pruner stopped at which rung, and the leader's hyperparameters. The run's time is split into
search, re-runs, audits and the baseline (summed trial wall times: with two trials at once they
add up to about twice the run's wall time, which ``summary.json`` gives). Writes
``bench/results/NAME.json`` and ``NAME.md`` (the Markdown table).

``--combine`` reads parts' results files (``bench/results/<part>.json``), puts their studies in
one table and states each seed paper's claim against DP-SGD at the same epsilon (``CLAIMS``):
test accuracy mean ± sd over seeds, the difference, and its ratio to the standard error of the
difference (Welch); for LM-DP-SGD also the peak per-layer MIA.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import RESULTS_DIR, write_results
from dpsweep.core import layout
from dpsweep.orchestrator import api
from dpsweep.orchestrator.audit.membership import claim_check

#: The seed papers' claims re-tested against DP-SGD: (series, epsilon, what the paper reports).
CLAIMS = (("dpsgd_lf", 1.0, "paper: 0.801 -> 0.815 test accuracy on Fashion-MNIST at epsilon 1"),
          ("dp_adamilg", 3.0, "paper: higher accuracy than DP-SGD at equal epsilon"),
          ("ww_dpsgd", 3.0, "paper: higher accuracy than DP-SGD at equal epsilon"),
          ("lm_dpsgd", 3.0, "paper: lower per-layer MIA than DP-SGD at equal utility"))
BASELINE_SERIES = "dpsgd"


def _mean_sd(values: list[float]) -> tuple[float, float]:
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    if arr.size == 0:
        return math.nan, math.nan
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def _is_baseline(frame: Any) -> Any:
    return (frame["method"].astype(str).str.startswith("nonprivate")
            | (frame["series"].astype(str) == "nonprivate"))


def _seconds(values: Any) -> float:
    arr = np.asarray(values, dtype=float)
    return float(arr[np.isfinite(arr)].sum())


def time_split(frame: Any, run_dir: Path) -> dict[str, float]:
    """Summed trial wall times per phase, and the run's own wall time (``summary.json``)."""
    base = _is_baseline(frame)
    rerun = frame["repeat_of"].fillna("") != ""
    split = {"search_s": _seconds(frame[~base & ~rerun]["train_seconds"]),
             "reruns_s": _seconds(frame[~base & rerun]["train_seconds"]),
             "audits_s": _seconds(frame[~base]["audit_seconds"]),
             "baseline_s": _seconds(frame[base]["train_seconds"])
             + _seconds(frame[base]["audit_seconds"])}
    summary = run_dir / layout.SUMMARY
    if summary.is_file():
        split["wall_s"] = float(json.loads(summary.read_text())["wall_seconds"])
    return split


def _audit_fields(run_dir: Path, a: Any) -> dict[str, Any]:
    record = json.loads((run_dir / layout.TRIALS / a["trial_id"] / layout.AUDIT).read_text())
    return {"audited": a["trial_id"], "peak_mia": float(a["peak_mia_accuracy"]),
            "peak_mia_upper": float(a["peak_mia_upper"]), "peak_layer": a["peak_layer"],
            "peak_attack": a["peak_attack"], "leak_detected": bool(a["leak_detected"]),
            "leak_p": float(a["leak_p_value"]),
            "claim_check": claim_check(record, epsilon=float(a["epsilon_upper"]),
                                       delta=float(a["delta"])),
            "n_candidates": record["n_candidates"], "audit_mode": record["mode"],
            "n_references": record["n_references"]}


def _study_row(run_dir: Path, group: Any, everything: Any, runs: Any) -> dict[str, Any]:
    """One study: its validation leader, the leader's re-runs, the pruner's work, the audit."""
    best = group.loc[group["val_accuracy"].astype(float).idxmax()]
    seeds = [best, *[r for _, r in runs[runs["repeat_of"] == best["trial_id"]].iterrows()]]
    val = _mean_sd([float(r["val_accuracy"]) for r in seeds])
    test = _mean_sd([float(r["test_accuracy"]) for r in seeds])
    pruned = everything[everything["status"] == "pruned"]
    row: dict[str, Any] = {
        "series": best["series"], "epsilon": float(best["target_epsilon"]),
        "trial": best["trial_id"], "dp_valid": bool(best["dp_valid"]), "seeds": len(seeds),
        "val_mean": val[0], "val_sd": val[1], "test_mean": test[0], "test_sd": test[1],
        "test_seeds": [float(r["test_accuracy"]) for r in seeds],
        "trials": len(everything), "finished": len(group), "pruned": len(pruned),
        "pruned_at": {str(k): int(v) for k, v in pruned["pruned_at"].value_counts().items()},
        "failed": int((everything["status"] == "failed").sum()),
        "lr": float(best["lr"]), "clip_norm": float(best["clip_norm"]),
        "momentum": float(best["momentum"]), "epsilon_upper": float(best["epsilon_upper"]),
        "noise_multiplier": float(best["noise_multiplier"]), "steps": int(best["steps"]),
        "batch_size": int(best["batch_size"])}
    audited = [r for r in seeds if math.isfinite(float(r["peak_mia_accuracy"]))]
    if audited:
        row.update(_audit_fields(run_dir, audited[0]))
    return row


def summarise(run_dir: Path) -> dict[str, Any]:
    frame = api.results(run_dir)
    base = _is_baseline(frame)
    search = frame[~base & (frame["repeat_of"].fillna("") == "")]
    runs = frame[(frame["status"] == "ok") & (frame["repeat_of"].fillna("") != "")]
    rows = []
    for (_series, _eps), everything in search.groupby(["series", "target_epsilon"], sort=True):
        group = everything[everything["status"] == "ok"]
        if len(group):
            rows.append(_study_row(run_dir, group, everything, runs))
    baseline = None
    if base.any():
        b = frame[base].iloc[0]
        baseline = {"val": float(b["val_accuracy"]), "test": float(b["test_accuracy"]),
                    "peak_mia": float(b["peak_mia_accuracy"]),
                    "leak_detected": bool(b["leak_detected"])}
    return {"rows": rows, "baseline": baseline, "trials": len(frame),
            "failed": int((frame["status"] == "failed").sum()),
            "pruned": int((frame["status"] == "pruned").sum()),
            "time": time_split(frame, run_dir), "run_dir": str(run_dir)}


def _pm(mean: float, sd: float, n: int) -> str:
    """mean ± sd over seeds (a single seed has no spread to show)."""
    return f"{mean:.3f} ± {sd:.3f}" if n > 1 else f"{mean:.3f}"


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| series | epsilon | seeds | val acc | test acc | peak MIA [upper] | "
             "peak at | leak | ROC eps lower |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        peak = (f"{r['peak_mia']:.3f} [{r['peak_mia_upper']:.3f}]" if "peak_mia" in r else "-")
        where = f"{r['peak_layer']} ({r['peak_attack']})" if "peak_mia" in r else "-"
        leak = ("yes" if r.get("leak_detected") else "no") if "peak_mia" in r else "-"
        roc = (f"{r['claim_check']['mia_epsilon_lower']:.3f}" if "claim_check" in r else "-")
        valid = "" if r["dp_valid"] else " (claim invalid)"
        lines.append(f"| {r['series']}{valid} | {r['epsilon']:g} | {r['seeds']} | "
                     f"{_pm(r['val_mean'], r['val_sd'], r['seeds'])} | "
                     f"{_pm(r['test_mean'], r['test_sd'], r['seeds'])} | {peak} | "
                     f"{where} | {leak} | {roc} |")
    b = summary.get("baseline")
    if b:
        lines.append(f"| non-private | - | 1 | {b['val']:.3f} | {b['test']:.3f} | "
                     f"{b['peak_mia']:.3f} | | {'yes' if b['leak_detected'] else 'no'} | |")
    return "\n".join(lines)


def details(summary: dict[str, Any]) -> str:
    """Per study: the search's work and the leader; then the time split."""
    lines = ["| series | epsilon | trials (finished / pruned: at epoch) | leader lr, C, momentum "
             "| sigma, steps | test acc per seed |", "|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        rungs = ", ".join(f"{n} at {k}" for k, n in sorted(r.get("pruned_at", {}).items(),
                                                           key=lambda kv: int(kv[0])))
        lines.append(
            f"| {r['series']} | {r['epsilon']:g} | {r['trials']} ({r['finished']} / "
            f"{r['pruned']}{': ' + rungs if rungs else ''}) | {r['lr']:.3g}, "
            f"{r['clip_norm']:.3g}, {r['momentum']:g} | {r['noise_multiplier']:.3f}, "
            f"{r['steps']} | {', '.join(f'{t:.3f}' for t in r['test_seeds'])} |")
    for name, t in summary.get("part_times", {}).items():
        if t:
            lines.append(f"\n{name}: " + _time_line(t))
    t = summary.get("time", {})
    if t:
        lines.append("\n" + _time_line(t))
    return "\n".join(lines)


def _time_line(t: dict[str, float]) -> str:
    return ("time (summed trial wall times, minutes): search "
            f"{t['search_s'] / 60:.1f}, re-runs {t['reruns_s'] / 60:.1f}, audits "
            f"{t['audits_s'] / 60:.1f}, baseline {t['baseline_s'] / 60:.1f}"
            + (f"; run wall time {t['wall_s'] / 60:.1f}" if "wall_s" in t else ""))


def claims(rows: list[dict[str, Any]]) -> list[str]:
    """One sentence per seed paper's claim, against DP-SGD at the same epsilon."""
    by = {(r["series"], r["epsilon"]): r for r in rows}
    out = []
    for series, eps, paper in CLAIMS:
        a, b = by.get((series, eps)), by.get((BASELINE_SERIES, eps))
        if a is None or b is None:
            out.append(f"{series} vs {BASELINE_SERIES} at epsilon {eps:g}: not run yet.")
            continue
        diff = a["test_mean"] - b["test_mean"]
        se = math.sqrt(a["test_sd"] ** 2 / a["seeds"] + b["test_sd"] ** 2 / b["seeds"])
        spread = f" ({diff / se:+.1f} standard errors)" if se > 0 else ""
        text = (f"{series} vs {BASELINE_SERIES} at epsilon {eps:g}: test accuracy "
                f"{_pm(a['test_mean'], a['test_sd'], a['seeds'])} vs "
                f"{_pm(b['test_mean'], b['test_sd'], b['seeds'])} ({a['seeds']} and "
                f"{b['seeds']} seeds), difference {diff:+.3f}{spread} ({paper})")
        if "peak_mia" in a and "peak_mia" in b:
            text += (f"; peak per-layer MIA {a['peak_mia']:.3f} [upper {a['peak_mia_upper']:.3f}]"
                     f" vs {b['peak_mia']:.3f} [{b['peak_mia_upper']:.3f}]")
        out.append(text + ".")
    return out


def combine(parts: list[str]) -> dict[str, Any]:
    """The parts' studies in one table (a study run in two parts: the first part's)."""
    rows: dict[tuple[str, float], dict[str, Any]] = {}
    baseline, times = None, {}
    for name in parts:
        path = RESULTS_DIR / f"{name}.json"
        if not path.is_file():
            raise SystemExit(f"--combine: {path} does not exist (run and summarise that part)")
        part = json.loads(path.read_text())
        for r in part["rows"]:
            rows.setdefault((r["series"], r["epsilon"]), {**r, "part": name})
        baseline = baseline or part.get("baseline")
        times[name] = part.get("time", {})
    ordered = [rows[k] for k in sorted(rows)]
    return {"rows": ordered, "baseline": baseline, "parts": parts, "time": {},
            "part_times": times, "claims": claims(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?", default=Path("runs/fmnist"))
    parser.add_argument("--name", default="fmnist_study",
                        help="results file bench/results/NAME.json (and NAME.md)")
    parser.add_argument("--combine", nargs="+", metavar="PART",
                        help="combine these parts' results files instead of reading a run")
    args = parser.parse_args()
    summary = combine(args.combine) if args.combine else summarise(args.run_dir)
    text = markdown(summary) + "\n\n" + details(summary)
    if args.combine:
        text += "\n\n" + "\n".join(f"- {c}" for c in summary["claims"])
    print(text)
    path = write_results(args.name, summary)
    path.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {path} and {path.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
