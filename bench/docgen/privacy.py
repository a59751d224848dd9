"""Generated tables of docs/privacy.md: what the certified norms cost in clipping and in step
time, and what secure randomness costs against secret.

Each table is built from one committed ``bench/results/<name>.json`` (``bench.overclip``,
``bench.versus``, ``bench.secure_cost``); ratios are medians of interleaved per-round ratios
with their interquartile range, never a best run. ``bench.docgen`` owns the blocks and
checks them; this module only formats.
"""

from __future__ import annotations

from bench.docgen.runs import load_results, missing_results

OVERCLIP = "overclip"
#: The step of the certified engine against the commit before it (``bench.versus --name``).
VERSUS_CERTIFIED = "versus_certified"
SECURE_COST = "secure_cost"
MODEL_NAMES = {"cnn28": "cnn28", "resnet20_gn": "ResNet-20-GN"}


def overclip_table() -> str:
    run = load_results(OVERCLIP)
    if run is None:
        return missing_results(OVERCLIP, "overclip")
    lines = ["| model | branch | clipped | mean factor, certified / exact | smallest | "
             "layer excess, median | largest | under-normed |",
             "|---|---|---|---|---|---|---|---|"]
    for model, row in run["models"].items():
        for branch in ("cpu", "accelerator"):
            r = row[branch]
            medians = sorted(r["layer_excess_median"])
            lines.append(
                f"| {MODEL_NAMES.get(model, model)} | {branch} | {r['clipped']}/{row['batch']} "
                f"| {r['factor_mean']:.6f} | {r['factor_min']:.6f} "
                f"| {medians[len(medians) // 2]:.1e} | {max(r['layer_excess_max']):.1e} "
                f"| {r['under_normed']} |")
    return (f"From `bench/results/{OVERCLIP}.json`: per model and branch, how many of the batch "
            "are clipped, the clipping factor min(1, C / norm) from certified over exact norms "
            "(mean over the batch, and the smallest), each layer's certified norm over its exact "
            "one minus 1 (median over layers of the per-layer medians, and the largest of any "
            "example), and the (example, layer) norms below the exact one by more than the "
            "float32 model's own rounding (1e-5).\n\n" + "\n".join(lines))


def versus_table() -> str:
    run = load_results(VERSUS_CERTIFIED)
    if run is None:
        return missing_results(VERSUS_CERTIFIED, "versus --name versus_certified")
    lines = ["| model | step, certified (median ms) | step, before (median ms) | "
             "per-round ratio (median) | IQR |", "|---|---|---|---|---|"]
    for model, row in run["models"].items():
        head, base = row["head"], row["base"]
        lines.append(f"| {MODEL_NAMES.get(model, model)} | {head['median_s'] * 1e3:.1f} "
                     f"| {base['median_s'] * 1e3:.1f} | {head['ratio_per_round_median']:.3f} "
                     f"| {head['ratio_per_round_q1']:.3f}-{head['ratio_per_round_q3']:.3f} |")
    return (f"From `bench/results/{VERSUS_CERTIFIED}.json`: the dpsgd step at `{run['head']}` "
            f"against `{run['base']}` (the engine before certified norms), {run['rounds']} "
            "interleaved rounds in one run.\n\n" + "\n".join(lines))


def secure_cost_table() -> str:
    run = load_results(SECURE_COST)
    if run is None:
        return missing_results(SECURE_COST, "secure_cost")
    lines = ["| model | rounds | step, secure / secret (median) | IQR | batch draw, secure / "
             "secret |", "|---|---|---|---|---|"]
    for model, row in run["models"].items():
        step, draw = row["ratios"]["step"], row["ratios"]["sample"]
        lines.append(f"| {MODEL_NAMES.get(model, model)} | {row['config']['rounds']} "
                     f"| {step['ratio_median']:.3f} | {step['ratio_q1']:.3f}-"
                     f"{step['ratio_q3']:.3f} | {draw['ratio_median']:.2f} |")
    return (f"From `bench/results/{SECURE_COST}.json` (`bench/secure_cost.py`): the dpsgd step "
            "with `secure` randomness over the same step with `secret`, per-round ratios of "
            "interleaved rounds.\n\n" + "\n".join(lines))


GENERATORS = {"overclip": overclip_table, "versus_certified": versus_table,
              "secure_cost": secure_cost_table}
