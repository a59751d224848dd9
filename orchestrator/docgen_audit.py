"""Generated table of docs/audit.md: what a membership audit costs against the trial's own
training.

The table is built from the committed ``bench/results/audit_cost.json`` (``bench.audit_cost``);
ratios are medians of per-round ratios of interleaved rounds with their interquartile range,
never a best run. ``orchestrator.docgen`` owns the block and checks it; this module only
formats.
"""

from __future__ import annotations

from orchestrator.docgen_runs import load_results, missing_results

AUDIT_COST = "audit_cost"
AUDIT_STRENGTH = "audit_strength"
#: The bench's entries (``bench.audit_cost``): the training, the audit, the audit before.
TRAIN = "train"
AUDIT = "audit"
BEFORE = "audit before"


def _ratio(entry: dict[str, float]) -> str:
    return (f"{entry['ratio_per_round_median']:.1f} ({entry['ratio_per_round_q1']:.1f}-"
            f"{entry['ratio_per_round_q3']:.1f})")


def audit_cost_table() -> str:
    run = load_results(AUDIT_COST)
    if run is None:
        return missing_results(AUDIT_COST, "audit_cost")
    lines = ["| target | training (median s) | audit before (median s) | before / training | "
             "audit (median s) | audit / training | rounds |", "|---|---|---|---|---|---|---|"]
    for row in run["recipes"].values():
        s = row["summary"]
        lines.append(f"| {row['describe']} | {s[TRAIN]['median_s']:.1f} "
                     f"| {s[BEFORE]['median_s']:.1f} | {_ratio(s[BEFORE])} "
                     f"| {s[AUDIT]['median_s']:.1f} | {_ratio(s[AUDIT])} | {row['rounds']} |")
    return (f"From `bench/results/{AUDIT_COST}.json` (`bench/audit_cost.py`): a DP-SGD target "
            "(epsilon 3) trained as a trial trains it, and the default audit of it (4 offline "
            "references, layer probes, no reference cache), with and without the savings "
            "above, timed in interleaved rounds on one thread; ratios are the median "
            "(interquartile range) of the per-round ratios to the round's training.\n\n"
            + "\n".join(lines))


def _median_range(stat: dict[str, float]) -> str:
    return f"{stat['median']:.3f} ({stat['min']:.3f}-{stat['max']:.3f})"


def audit_strength_table() -> str:
    run = load_results(AUDIT_STRENGTH)
    if run is None:
        return missing_results(AUDIT_STRENGTH, "audit_strength")
    lines = ["| plan | reference trainings | TPR at 1% FPR | TPR at 0.1% FPR | AUC |",
             "|---|---|---|---|---|"]
    for name, plan in sorted(run["plans"].items(), key=lambda kv: (
            kv[0].startswith("candidate"), kv[1]["reference_trainings"], kv[0])):
        best = plan["attacks"]["any"]["strongest"]
        low = _median_range(best["tpr_at_01pct"]) + (
            "" if best["tpr_at_01pct_meaningful"] else " *")
        lines.append(f"| {name} | {plan['reference_trainings']} "
                     f"| {_median_range(best['tpr_at_1pct'])} | {low} "
                     f"| {_median_range(best['auc'])} |")
    setup = run["setup"]
    return (f"From `bench/results/{AUDIT_STRENGTH}.json` (`bench/audit_strength.py`): a "
            f"memorising model ({setup['model']}) on {setup['dataset']} (non-private Adam, "
            f"{setup['epochs']} epochs), each plan's strongest cell (attack x signal, chosen "
            f"with the membership labels, so optimistic), median and range over "
            f"{len(run['seeds'])} seeds. * with this few non-members the 0.1% point allows "
            "no false positive: not a meaningful rate.\n\n" + "\n".join(lines))


GENERATORS = {"audit_cost": audit_cost_table, "audit_strength": audit_strength_table}
