"""The stock models' factories, their speed bench (``bench.stock_models``) and its table.

The bench must record a model dpsweep refuses, or Opacus cannot run, instead of crashing; the
docs table (``docs/stock-models.md``) is generated from the committed results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import stock_models as sm
from bench.docgen import blocks as docgen
from dpsweep.core.errors import UserInputError

STOCK = sm.load_stock().STOCK


@pytest.mark.parametrize("name", list(STOCK))
def test_every_factory_returns_logits_for_its_input(name: str) -> None:
    s = STOCK[name]
    net = s.factory(input_shape=s.input_shape, num_classes=7)
    x = s.sample(3)
    assert x.dtype == (torch.int64 if s.tokens else torch.float32)
    assert tuple(x.shape) == (3, *s.input_shape)
    with torch.no_grad():
        assert tuple(net(x).shape) == (3, 7)
    assert name in sm.load_stock().__doc__


def test_the_frozen_resnet_trains_only_its_head() -> None:
    s = STOCK["resnet18_fc"]
    net = s.factory(input_shape=s.input_shape, num_classes=10)
    assert {n for n, p in net.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}


def _kinds(net: torch.nn.Module) -> set[str]:
    return {type(m).__name__ for m in net.modules()}


def test_the_fixed_resnet_is_stock_until_fixed() -> None:
    s = STOCK["resnet18_fixed"]
    assert s.fix and "BatchNorm2d" in _kinds(s.build(10, fixed=False))
    fixed = s.build(10)
    assert "GroupNorm" in _kinds(fixed) and not any("BatchNorm" in k for k in _kinds(fixed))
    module = sm.load_stock()
    assert _kinds(module.build_resnet18_fixed(s.input_shape, 10)) == _kinds(fixed)
    norms = [m for m in fixed.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert {(m.num_groups, m.num_channels) for m in norms} >= {(32, 64), (32, 512)}


def _row(name: str = "lstm") -> dict:
    pytest.importorskip("opacus")
    return sm.bench_model(name, batch=4, rounds=1, threads=1)


def test_a_row_holds_every_entry_that_runs() -> None:
    row = _row()
    assert row["ours"]["status"] in ("ok", "refused", "failed")
    assert row["opacus"]["status"] in ("ok", "n/a")
    assert row["opacus"]["fixed"] == ["1 x LSTM -> DPLSTM"]
    assert sm.BASELINE in row["time"]
    for entry, info in ((sm.OURS, row["ours"]), (sm.OPACUS, row["opacus"])):
        assert (entry in row["time"]) == (info["status"] == "ok"), entry
        assert (info["status"] == "ok") == ("reason" not in info)
    both = sm.OURS in row["time"] and sm.OPACUS in row["time"]
    assert (row["ours_vs_opacus"] is not None) == both
    assert (row["within_target"] is None) == (not both)


def test_a_refused_model_is_recorded_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(source, **kwargs) -> None:
        raise UserInputError(field="model.factory", value="x", allowed="something else")

    monkeypatch.setattr(sm, "build_network", refuse)
    row = _row()
    assert row["ours"] == {"status": "refused", "reason": "model.factory = 'x' is not "
                                                          "allowed: expected something else"}
    assert sm.OURS not in row["time"] and row["ours_vs_opacus"] is None


def test_a_model_opacus_cannot_run_is_recorded_as_na(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(net):
        raise RuntimeError("no grad sampler\nsecond line")

    monkeypatch.setattr(sm, "_opacus_fix", broken)
    row = _row()
    assert row["opacus"]["status"] == "n/a"
    assert row["opacus"]["reason"].startswith("RuntimeError: no grad sampler (at ")
    long = RuntimeError("A first sentence. " + "x" * 300)
    assert sm.error_line(long) == "RuntimeError: A first sentence."
    assert sm.OPACUS not in row["time"] and row["within_target"] is None


def test_the_cli_writes_a_partial_run_without_touching_the_docs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opacus")
    import bench.harness

    monkeypatch.setattr(bench.harness, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(sm, "_commit", lambda: "abc")  # git's process: a unit test starts none
    doc = (docgen.ROOT / docgen.STOCK_DOC).read_text()
    sm.main(["--models", "gru", "--rounds", "1", "--batch", "4", "--threads", "1"])
    payload = json.loads((tmp_path / f"{sm.PARTIAL_RESULTS}.json").read_text())
    assert payload["order"] == list(payload["models"]) == ["gru"] and payload["rounds"] == 1
    assert payload["commit"] == "abc"
    assert payload["models"]["gru"]["input"] == "token ids [4, 32] int64"
    assert (docgen.ROOT / docgen.STOCK_DOC).read_text() == doc
    assert "| `gru` |" in docgen.stock_speed_markdown(payload)


def _timed(median: float) -> dict:
    return {"median_s": median, "ratio_per_round_median": median / 0.01}


def _payload() -> dict:
    ok = {"input": "token ids [64, 32] int64", "trainable_params": 1234,
          "time": {"non-private": _timed(0.01), "dpsweep DP-SGD": _timed(0.02),
                   "opacus hooks": _timed(0.04)},
          "ours": {"status": "ok", "path": "engine"},
          "opacus": {"status": "ok", "fixed": ["1 x LSTM -> DPLSTM"], "functorch": []},
          "ours_vs_opacus": {"median": 0.5, "q1": 0.45, "q3": 0.55}, "within_target": True}
    slow = {**ok, "ours_vs_opacus": {"median": 1.5, "q1": 1.4, "q3": 1.6},
            "within_target": False, "opacus": {**ok["opacus"], "functorch": ["(root)"]}}
    refused = {**ok, "time": {"non-private": _timed(0.01)}, "ours_vs_opacus": None,
               "within_target": None, "ours": {"status": "refused", "reason": "a | b"},
               "opacus": {"status": "n/a", "reason": "RuntimeError: no", "fixed": [],
                          "functorch": []}}
    return {"date": "2026-11-27", "commit": "abc", "torch": "2", "torchvision": "0",
            "opacus": "1", "machine": "x86_64, 2 CPUs", "threads": 2, "rounds": 7,
            "target": 1.0, "wall_s": 120.0,
            "models": {"lstm": ok, "gru": slow, "vit": refused}}


def test_the_table_shows_ratios_verdicts_and_reasons() -> None:
    lines = docgen.stock_speed_markdown(_payload()).splitlines()
    rows = {line.split(" | ")[0].strip("| `"): line for line in lines if line.startswith("| `")}
    assert "| 20.0 (2.00x) | 40.0 (4.00x) | engine | fix: 1 x LSTM -> DPLSTM |" in rows["lstm"]
    assert rows["lstm"].endswith("| **0.50** (0.45-0.55) | yes |")
    assert rows["gru"].endswith("| **1.50** (1.40-1.60) | **no** |")
    assert "torch.func on (root)" in rows["gru"]
    assert "| refused [1] | n/a [2] |" in rows["vit"] and rows["vit"].endswith("| - | - |")
    assert "- [1] `vit`, dpsweep refused: a \\| b" in lines
    assert "- [2] `vit`, Opacus n/a: RuntimeError: no" in lines
    assert "whole run 120 s" not in lines[0] and "whole run 2.0 min" in lines[0]


def test_the_committed_page_is_generated_from_the_committed_results() -> None:
    doc = (docgen.ROOT / docgen.STOCK_DOC).read_text()
    assert docgen.render(doc, "stock_speed") == doc, "run `python -m bench.docgen`"
    results = docgen.ROOT / docgen.STOCK_RESULTS
    if results.is_file():
        payload = json.loads(results.read_text())
        assert payload["order"] == list(STOCK) and set(payload["models"]) == set(STOCK)
        assert all(f"| `{name}` |" in doc for name in STOCK)
