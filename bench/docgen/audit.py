"""Generated tables of docs/audit.md: what a membership audit costs against the trial's own
training, how strong each plan is, and the frozen-backbone recipe run with ``dpsweep run``.

The tables are built from the committed ``bench/results/audit_cost.json``
(``bench.audit_cost``), ``audit_strength.json`` and ``frozen_run.json``; ratios are medians
of per-round ratios of interleaved rounds with their interquartile range, never a best run.
``bench.docgen`` owns the blocks and checks them; this module only formats.
"""

from __future__ import annotations

from bench.docgen.runs import load_results, missing_results

AUDIT_COST = "audit_cost"
AUDIT_STRENGTH = "audit_strength"
FROZEN_RUN = "frozen_run"
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
    settings = run["settings"]
    return (f"From `bench/results/{AUDIT_COST}.json` (`bench/audit_cost.py`): a DP-SGD target "
            "(epsilon 3) trained as a trial trains it, and the default audit of it "
            f"({settings['reference_models']} {settings['references']} references, layer "
            "probes, no reference cache), with and without the savings "
            "above, timed in interleaved rounds on one thread; ratios are the median "
            "(interquartile range) of the per-round ratios to the round's training.\n\n"
            + "\n".join(lines))


def _median_range(stat: dict[str, float]) -> str:
    return f"{stat['median']:.3f} ({stat['min']:.3f}-{stat['max']:.3f})"


def audit_strength_table() -> str:
    run = load_results(AUDIT_STRENGTH)
    if run is None:
        return missing_results(AUDIT_STRENGTH, "audit_strength")
    lines = ["| plan | reference trainings per trial | references scored | TPR at 1% FPR "
             "| TPR at 0.1% FPR | AUC |", "|---|---|---|---|---|---|"]
    for name, plan in sorted(run["plans"].items(),
                             key=lambda kv: (kv[1]["reference_trainings"],
                                             kv[1]["n_references"], kv[0])):
        best = plan["attacks"]["any"]["strongest"]
        low = _median_range(best["tpr_at_01pct"]) + (
            "" if best["tpr_at_01pct_meaningful"] else " *")
        lines.append(f"| {name} | {plan['reference_trainings']} | {plan['n_references']} "
                     f"| {_median_range(best['tpr_at_1pct'])} | {low} "
                     f"| {_median_range(best['auc'])} |")
    setup = run["setup"]
    return (f"From `bench/results/{AUDIT_STRENGTH}.json` (`bench/audit_strength.py`): a "
            f"memorising model ({setup['model']}) on {setup['dataset']} (non-private Adam, "
            f"{setup['epochs']} epochs), each plan's strongest cell (attack x signal, chosen "
            f"with the membership labels, so optimistic), median and range over "
            f"{len(run['seeds'])} seeds. * with this few non-members the 0.1% point allows "
            "no false positive: not a meaningful rate.\n\n" + "\n".join(lines))


def frozen_run_table() -> str:
    run = load_results(FROZEN_RUN)
    if run is None:
        return missing_results(FROZEN_RUN, "frozen_run")
    lines = ["| trial | training (s) | audit (s) | audit / training | references scored "
             "| peak MIA accuracy | layers reported shared |", "|---|---|---|---|---|---|---|"]
    for row in run["trials"]:
        peak = row["peak_mia_accuracy"]
        lines.append(f"| {row['trial_id']} | {row['train_seconds']:.1f} "
                     f"| {row['audit_seconds']:.1f} | {row['ratio']:.1f} "
                     f"| {row.get('n_references', '-')} "
                     f"| {'-' if peak is None else f'{peak:.3f}'} "
                     f"| {', '.join(row['shared_layers']) or 'none'} |")
    summary = run["summary"]
    return (f"From `bench/results/{FROZEN_RUN}.json` (`bench/frozen_run.py`): `{run['command']}` "
            f"as a user runs it, each trial's own training and audit seconds (the audit's with its "
            f"scoring again over the study's pooled references at the sweep's end); median audit / "
            f"training of the DP trials {summary['median_ratio']:.1f}, largest "
            f"{summary['max_ratio']:.1f} (load average {run['load_before']:.1f} before, "
            f"{run['load_after']:.1f} after; two trials run at once on 2 cores).\n\n"
            + "\n".join(lines))


GENERATORS = {"audit_cost": audit_cost_table, "audit_strength": audit_strength_table,
              "frozen_run": frozen_run_table}
