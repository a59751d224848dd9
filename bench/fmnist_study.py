"""Summarise the Fashion-MNIST study (``configs/fmnist.toml``) into the README's table.

    make data && .venv/bin/dpsweep run configs/fmnist.toml --out runs/fmnist
    .venv/bin/python -m bench.fmnist_study runs/fmnist

Per series and epsilon: the tuned configuration (the study's best validation trial) and its
re-runs with fresh noise (``sweep.seeds``) give mean ± sd of validation and test accuracy over
seeds; the audited front trial gives the peak MIA with its simultaneous upper bound, the layer
and attack of the peak, whether a leak was detected, and every measured ROC point checked against
the claimed epsilon (``orchestrator.audit.membership.claim_check``). Writes
bench/results/fmnist_study.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import write_results
from core import layout
from orchestrator import api
from orchestrator.audit.membership import AUDIT_FILE, claim_check

#: Pairs compared in the README's sentences: (series, baseline series).
VERSUS = (("dpsgd_lf", "dpsgd"), ("lm_dpsgd", "dpsgd"), ("ww_dpsgd", "dpsgd"),
          ("dp_adamilg", "dpsgd"), ("auto_s", "dpsgd"), ("dp_psac", "dpsgd"))


def _mean_sd(values: list[float]) -> tuple[float, float]:
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    if arr.size == 0:
        return math.nan, math.nan
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def summarise(run_dir: Path) -> dict[str, Any]:
    frame = api.results(run_dir)
    ok = frame[frame["status"] == "ok"]
    rows: list[dict[str, Any]] = []
    runs = ok[ok["repeat_of"].fillna("") != ""]
    for (series, eps), group in ok[ok["repeat_of"].fillna("") == ""].groupby(
            ["series", "target_epsilon"], sort=True):
        best = group.loc[group["val_accuracy"].astype(float).idxmax()]
        seeds = [best, *[r for _, r in runs[runs["repeat_of"] == best["trial_id"]].iterrows()]]
        val = _mean_sd([float(r["val_accuracy"]) for r in seeds])
        test = _mean_sd([float(r["test_accuracy"]) for r in seeds])
        row: dict[str, Any] = {
            "series": series, "epsilon": float(eps), "trial": best["trial_id"],
            "dp_valid": bool(best["dp_valid"]), "seeds": len(seeds),
            "val_mean": val[0], "val_sd": val[1], "test_mean": test[0], "test_sd": test[1],
            "trials": len(group)}
        audited = [r for r in seeds if math.isfinite(float(r["peak_mia_accuracy"]))]
        if audited:
            a = audited[0]
            row.update({"audited": a["trial_id"], "peak_mia": float(a["peak_mia_accuracy"]),
                        "peak_mia_upper": float(a["peak_mia_upper"]),
                        "peak_layer": a["peak_layer"], "peak_attack": a["peak_attack"],
                        "leak_detected": bool(a["leak_detected"]),
                        "leak_p": float(a["leak_p_value"])})
            record = json.loads((run_dir / layout.TRIALS / a["trial_id"] / AUDIT_FILE).read_text())
            row["claim_check"] = claim_check(record, epsilon=float(a["epsilon_upper"]),
                                             delta=float(a["delta"]))
            row["n_candidates"] = record["n_candidates"]
            row["audit_mode"] = record["mode"]
            row["n_references"] = record["n_references"]
        rows.append(row)
    baseline = frame[frame["method"].astype(str).str.startswith("nonprivate")
                     | (frame["series"].astype(str) == "nonprivate")]
    base = None
    if not baseline.empty:
        b = baseline.iloc[0]
        base = {"val": float(b["val_accuracy"]), "test": float(b["test_accuracy"]),
                "peak_mia": float(b["peak_mia_accuracy"]),
                "leak_detected": bool(b["leak_detected"])}
    return {"rows": rows, "baseline": base, "trials": len(frame),
            "failed": int((frame["status"] != "ok").sum())}


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| series | epsilon | val acc (3 seeds) | test acc (3 seeds) | peak MIA [upper] | "
             "peak at | leak | ROC eps lower |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        peak = (f"{r['peak_mia']:.3f} [{r['peak_mia_upper']:.3f}]" if "peak_mia" in r else "-")
        where = f"{r['peak_layer']} ({r['peak_attack']})" if "peak_mia" in r else "-"
        leak = ("yes" if r.get("leak_detected") else "no") if "peak_mia" in r else "-"
        roc = (f"{r['claim_check']['mia_epsilon_lower']:.3f}" if "claim_check" in r else "-")
        valid = "" if r["dp_valid"] else " (claim invalid)"
        lines.append(f"| {r['series']}{valid} | {r['epsilon']:g} | {r['val_mean']:.3f} ± "
                     f"{r['val_sd']:.3f} | {r['test_mean']:.3f} ± {r['test_sd']:.3f} | {peak} | "
                     f"{where} | {leak} | {roc} |")
    b = summary.get("baseline")
    if b:
        lines.append(f"| non-private | - | {b['val']:.3f} | {b['test']:.3f} | "
                     f"{b['peak_mia']:.3f} | | {'yes' if b['leak_detected'] else 'no'} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?", default=Path("runs/fmnist"))
    args = parser.parse_args()
    summary = summarise(args.run_dir)
    print(markdown(summary))
    print(f"wrote {write_results('fmnist_study', summary)}")


if __name__ == "__main__":
    main()
