"""Re-scoring ``lira_pooled`` from an audit-strength dump (``bench/audit_strength_rescore.py``):
the dump round-trips, the audit's own attack reproduces the dumped cells, a variant replaces
only the ``lira_pooled`` cells, and the summary compares the plans as the bench does. No model
is trained here: the signals are synthetic."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from bench import audit_strength as bs
from bench import audit_strength_rescore as rs
from dpsweep.trainables.audit.scores import lira_pooled

N, K = 400, 16


def _signals(seed: int) -> SimpleNamespace:
    """An online plan's signals: complementary halves, membership lowers the signal by 1."""
    rng = np.random.default_rng(seed)
    in_mask = np.zeros((K, N), dtype=bool)
    for j in range(0, K, 2):
        in_mask[j, rng.permutation(N)[: N // 2]] = True
        in_mask[j + 1] = ~in_mask[j]
    is_member = rng.permutation(np.r_[np.ones(N // 2), np.zeros(N // 2)]).astype(bool)
    base = rng.normal(0.0, 2.0, N)
    refs = base + rng.normal(0.0, 0.5, (K, N)) - in_mask
    target = base + rng.normal(0.0, 0.5, N) - is_member
    noise = rng.normal(size=(K, N))
    return SimpleNamespace(
        plan=SimpleNamespace(is_member=is_member, in_mask=in_mask),
        target={"grad_norm:fc": target, "loss": rng.normal(size=N)},
        references={"grad_norm:fc": refs, "loss": noise})


def _run(seed: int) -> dict[str, Any]:
    """What ``run_seed`` returns, for the online rows: the audit's lira_pooled cells and a weak
    other cell (scores shifted by half a standard deviation for members)."""
    signals = _signals(seed)
    weak = np.random.default_rng(seed + 100).normal(size=N) + 0.5 * signals.plan.is_member
    plans = {}
    for row, kind, _, used in bs.PLAN_ROWS:
        if kind != rs.ONLINE:
            continue
        cells = {"rmia/loss": bs.cell_metrics(weak, signals.plan.is_member)}
        for name, values in signals.target.items():
            scores = lira_pooled(target=values, references=signals.references[name][:used],
                                 in_mask=signals.plan.in_mask[:used])
            cells[f"lira_pooled/{name}"] = bs.cell_metrics(scores, signals.plan.is_member)
        plans[row] = {"kind": kind, "n_references": used, "cells": cells}
    return {"seed": seed, "signals": {rs.ONLINE: signals}, "plans": plans}


@pytest.fixture
def dumps(tmp_path: Path) -> list[rs.SeedDump]:
    for seed in (3, 1):
        bs.dump_seed(_run(seed), directory=tmp_path)
    return rs.load_dumps(tmp_path)


def test_the_dump_round_trips(dumps: list[rs.SeedDump]) -> None:
    assert [d.seed for d in dumps] == [1, 3]
    signals = _signals(1)
    np.testing.assert_array_equal(dumps[0].in_mask, signals.plan.in_mask)
    np.testing.assert_array_equal(dumps[0].is_member, signals.plan.is_member)
    np.testing.assert_array_equal(dumps[0].references["grad_norm:fc"],
                                  signals.references["grad_norm:fc"])
    assert set(dumps[0].plans) == {rs.SHORT_ROW, rs.FULL_ROW}
    assert dumps[0].plans[rs.SHORT_ROW]["n_references"] == 4


def test_the_audits_attack_reproduces_the_dumped_cells(dumps: list[rs.SeedDump]) -> None:
    for dump in dumps:
        out = rs.rescore_seed(dump, rs.resolve(rs.DEFAULT_ATTACK))
        for row, r in out.items():
            for name, metrics in r["pooled"].items():
                assert metrics == dump.plans[row]["cells"][f"lira_pooled/{name}"]
            assert r["strongest"]["cell"] == "lira_pooled/grad_norm:fc"


def test_a_variant_replaces_only_the_pooled_cells(dumps: list[rs.SeedDump]) -> None:
    def blind(*, target: np.ndarray, references: np.ndarray, in_mask: np.ndarray
              ) -> np.ndarray:
        del references, in_mask
        return np.zeros_like(target)  # finds nobody: the other cell is the strongest

    out = rs.rescore_seed(dumps[0], blind)
    for row in (rs.SHORT_ROW, rs.FULL_ROW):
        assert out[row]["pooled"]["grad_norm:fc"]["tpr_at_1pct"] == 0.0
        assert out[row]["strongest"]["cell"] == "rmia/loss"


def test_the_summary_compares_the_plans_as_the_bench_does(dumps: list[rs.SeedDump]) -> None:
    per_seed = [rs.rescore_seed(d, lira_pooled) for d in dumps]
    summary = rs.summarise(per_seed)
    short, full = summary["rows"][rs.SHORT_ROW], summary["rows"][rs.FULL_ROW]
    assert short["values"] == [s[rs.SHORT_ROW]["strongest"]["tpr_at_1pct"] for s in per_seed]
    assert short["median"] == pytest.approx(np.median(short["values"]))
    assert summary["ratio_of_medians"] == pytest.approx(short["median"] / full["median"])
    ratios = [a / b for a, b in zip(short["values"], full["values"], strict=True)]
    assert summary["median_seed_ratio"] == pytest.approx(np.median(ratios))
    # only gradient-norm cells are averaged: one per seed here
    assert short["family_mean"] == pytest.approx(np.mean(
        [s[rs.SHORT_ROW]["pooled"]["grad_norm:fc"]["tpr_at_1pct"] for s in per_seed]))
    assert "median per-seed ratio" in rs.format_summary(summary)


def test_an_attack_is_named_module_colon_function() -> None:
    assert rs.resolve(rs.DEFAULT_ATTACK) is lira_pooled
    with pytest.raises(ValueError, match="module:function"):
        rs.resolve("dpsweep.trainables.audit.scores.lira_pooled")
