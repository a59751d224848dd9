"""The pure parts of the audit-strength bench (``bench/audit_strength.py``): TPR at a low FPR
by the audit's rule, its meaningful flag, the AUC, the per-plan views, the summary over seeds.
No model is trained here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import audit_strength as bs
from dpsweep.trainables.audit.plan_statement import MEASURED_TPR_AT_1PCT_FPR
from dpsweep.trainables.audit.scores import auc as audit_auc
from dpsweep.trainables.audit.stats.attacks import attack_statistics

ROOT = Path(__file__).resolve().parents[3]


def test_false_positives_allowed_by_a_target_fpr() -> None:
    assert bs.max_false_positives(0.01, 300) == 3
    assert bs.max_false_positives(0.001, 300) == 0
    assert bs.max_false_positives(0.01, 1000) == 10  # 0.01 x 1000 is not exactly 10.0
    assert bs.max_false_positives(0.001, 1000) == 1


def test_tpr_counts_members_strictly_above_the_allowed_non_member() -> None:
    nonmembers = np.arange(100.0)  # 1% of 100: one false positive, threshold 98
    members = np.array([99.5, 98.0, 98.5, 10.0])
    scores = np.r_[members, nonmembers]
    labels = np.r_[np.ones(4), np.zeros(100)]
    assert bs.tpr_at_fpr(scores, labels, 0.01) == (0.5, True)
    # 0.1% of 100 non-members is below one example: the TPR above all of them, flagged
    assert bs.tpr_at_fpr(scores, labels, 0.001) == (0.25, False)


def test_metrics_match_the_audits_own_statistics() -> None:
    rng = np.random.default_rng(0)
    labels = np.r_[np.ones(300, bool), np.zeros(300, bool)]
    scores = rng.normal(size=600) + 0.5 * labels
    scores[:5] = scores[300:305]  # ties across classes
    mine = bs.cell_metrics(scores, labels)
    theirs = attack_statistics(labels=labels, scores=bs.as_stored(scores))
    by_fpr = {t.target_fpr: t for t in theirs.tpr_at_fpr}
    assert mine["tpr_at_1pct"] == pytest.approx(by_fpr[0.01].tpr)
    assert mine["tpr_at_01pct"] == pytest.approx(by_fpr[0.001].tpr)
    assert mine["tpr_at_01pct_meaningful"] is by_fpr[0.001].meaningful is False
    assert mine["tpr_at_1pct_meaningful"] is True
    assert mine["auc"] == pytest.approx(theirs.auc)
    assert mine["auc"] == pytest.approx(audit_auc(scores=scores, labels=labels))


def _m(tpr: float, auc: float) -> dict:
    return {"tpr_at_1pct": tpr, "tpr_at_01pct": tpr / 2, "auc": auc,
            "tpr_at_1pct_meaningful": True, "tpr_at_01pct_meaningful": False}


def test_views_pick_the_output_and_the_best_layer() -> None:
    cells = {("loss", "lira_offline"): _m(0.02, 0.6), ("logit", "lira_offline"): _m(0.07, 0.66),
             ("grad_norm:fc1", "lira_offline"): _m(0.11, 0.69),
             ("grad_norm:fc2", "lira_offline"): _m(0.11, 0.70),
             ("logit", "rmia"): _m(0.05, 0.67), ("grad_norm:fc1", "rmia"): _m(0.12, 0.74),
             ("ir:fc1", "shadow_classifier"): _m(0.01, 0.6)}
    v = bs.views(cells)
    assert v["lira_offline"]["output_loss"]["tpr_at_1pct"] == 0.02
    assert v["lira_offline"]["output_logit"]["tpr_at_1pct"] == 0.07
    assert v["lira_offline"]["best_layer"]["cell"] == "grad_norm:fc2"  # tie: higher AUC
    assert v["rmia"]["output_loss"]["cell"] == "logit"  # RMIA reads the output once
    assert "output_loss" not in v["shadow_classifier"]
    assert v["any"]["strongest"]["cell"] == "rmia/grad_norm:fc1"


def test_seeds_are_summarised_by_median_and_range() -> None:
    runs = [{"rmia": {"best_layer": {**_m(t, 0.7), "cell": c}}}
            for t, c in ((0.1, "a"), (0.3, "b"), (0.2, "a"))]
    out = bs.aggregate(runs)["rmia"]["best_layer"]
    assert out["tpr_at_1pct"] == {"median": 0.2, "min": 0.1, "max": 0.3,
                                  "values": [0.1, 0.3, 0.2]}
    assert out["cells"] == ["a", "b", "a"] and out["tpr_at_01pct_meaningful"] is False
    plans = {"offline-4": {"reference_trainings": 4, "seconds": bs.spread([9.0, 11.0]),
                           "attacks": bs.aggregate(runs)}}
    table = bs.format_table(plans)
    assert "0.200 [0.100-0.300]" in table and "not meaningful" in table


def test_the_audit_record_quotes_the_committed_measurement() -> None:
    """``MEASURED_TPR_AT_1PCT_FPR`` (what every audit record says a plan finds) is the
    committed bench result, rounded: median, min and max of the strongest cell per plan."""
    results = json.loads((ROOT / "bench" / "results" / "audit_strength.json").read_text())
    quoted = {}
    for row, kind, _, used in bs.PLAN_ROWS:
        best = results["plans"][row]["attacks"]["any"]["strongest"]["tpr_at_1pct"]
        quoted[(kind, used)] = tuple(round(best[k], 2) for k in ("median", "min", "max"))
    pooled = results["plans"][bs.POOLED_ROW]
    best = pooled["attacks"]["any"]["strongest"]["tpr_at_1pct"]
    quoted[(bs.POOLED_KIND, pooled["n_references"])] = tuple(
        round(best[k], 2) for k in ("median", "min", "max"))
    assert quoted == MEASURED_TPR_AT_1PCT_FPR
