"""The report shows the layer x attack cells an audit did not score (reports/html/attacks.py,
reports/pareto.py): each layer with its status, attacks, trials and reason beside the heat map,
the cells in mia_layers.csv with their status, and a trial whose audit scored nothing kept off
the fronts for that reason, not as a failed audit."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from bench.synthetic_run import make_run
from dpsweep.reports import store
from dpsweep.reports.html import build_report
from dpsweep.reports.pareto import REASON_UNAUDITED, REASON_UNSCORED, exclusions

#: What the audit writes for a frozen backbone shared with every reference (its lead is
#: ``trainables.audit.exclusion.SHARED_FROZEN``).
FROZEN = ("frozen and shared with every reference: chance by construction (its output is "
          "bit-identical in the target and all 4 references on the 1000 examples compared)")
#: t6 sits on the front at epsilon 3 (its heat map row is drawn); t3 scores nothing.
PARTLY, NOTHING = "t6", "t3"


def _shared(layer: str, attack: str) -> dict[str, Any]:
    return {"layer": layer, "index": 0, "attack": attack, "signal": "sorted IR",
            "status": "shared", "reason": FROZEN}


def _hook(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if row["trial_id"] == PARTLY:
            cells = json.loads(row["mia_layers"])
            row["mia_layers"] = json.dumps([*cells, _shared("backbone", "shadow_classifier:ir")])
        elif row["trial_id"] == NOTHING:
            row.update({"mia_layers": json.dumps([_shared("backbone", "shadow_classifier:ir"),
                                                  _shared("head", "shadow_classifier:ir")]),
                        "peak_mia_accuracy": math.nan, "peak_mia_upper": math.nan,
                        "peak_layer": "", "peak_layer_index": -1, "peak_attack": ""})


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("unscored"), rows_hook=_hook)


def test_unscored_cells_are_listed_with_their_reason(run: Path) -> None:
    page = build_report(run)
    text = page.read_text()
    assert "Not scored." in text and "layer <b>backbone</b> (shared" in text
    assert FROZEN in text and "in 2 trials" in text
    cells = pd.read_csv(page.parent / "mia_layers.csv")
    mine = cells[(cells["trial_id"] == PARTLY) & (cells["layer"] == "backbone")]
    assert mine["status"].tolist() == ["shared"] and mine["reason"].tolist() == [FROZEN]
    assert mine["accuracy"].isna().all()


def test_a_trial_whose_audit_scored_nothing_is_kept_off_the_fronts_for_that(run: Path) -> None:
    reasons = exclusions(store.read_results(run)).set_index("trial_id")["reason"]
    assert reasons[NOTHING] == REASON_UNSCORED
    assert reasons["t12"].startswith(REASON_UNAUDITED)  # its audit failed: still says so
    assert PARTLY not in reasons
