"""The pruner's rule against known answers: rungs, the ASHA cutoff, decisions in arrival order,
idempotence, and seeding after a restart."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.trial.pruning import RungBoard, TrialPruned, cutoff, rungs


def test_rungs_grow_geometrically_below_the_last_epoch() -> None:
    assert rungs(epochs=8, min_epochs=2, factor=3) == (2, 6)
    assert rungs(epochs=40, min_epochs=1, factor=3) == (1, 3, 9, 27)
    assert rungs(epochs=2, min_epochs=2, factor=3) == ()
    with pytest.raises(UserInputError):
        rungs(epochs=8, min_epochs=1, factor=1)


@pytest.mark.parametrize("values", [[0.5], [0.1, 0.9], [0.3, 0.1, 0.7, 0.2], list(range(11))])
def test_cutoff_is_numpys_quantile(values: list[float]) -> None:
    for factor in (2, 3, 4):
        expected = float(np.quantile(values, 1 - 1 / factor))
        assert cutoff([float(v) for v in values], factor=factor) == pytest.approx(expected)
    assert cutoff([], factor=3) is None


def test_a_trial_continues_only_in_the_top_third_of_those_before_it() -> None:
    board = RungBoard(factor=3)
    arrivals = [("a", 0.5), ("b", 0.4), ("c", 0.6), ("d", 0.55), ("e", 0.5), ("f", math.nan)]
    kept = [board.decide(study="s", trial_id=t, rung=2, value=v) for t, v in arrivals]
    # a: the first, kept; b: 0.4 < 0.5; c: 0.6 >= q(0.5, 0.4) = 0.4667; d: 0.55 >= q(0.5, 0.4,
    # 0.6) = 0.5333; e: 0.5 < q(0.5, 0.4, 0.6, 0.55) = 0.55; f: a NaN never continues
    assert kept == [True, False, True, True, False, False]
    assert board.decide(study="s", trial_id="b", rung=2, value=0.99) is False  # asked again
    assert board.decide(study="other", trial_id="b", rung=2, value=0.1) is True  # own bracket


def test_seeded_decisions_are_kept_and_count_for_later_trials() -> None:
    board = RungBoard(factor=3)
    board.seed(study="s", trial_id="a", rung=2, value=0.8, kept=True)
    board.seed(study="s", trial_id="b", rung=2, value=0.2, kept=False)
    assert board.decide(study="s", trial_id="a", rung=2, value=0.0) is True
    assert board.decide(study="s", trial_id="c", rung=2, value=0.5) is False  # < 0.6
    assert board.decide(study="s", trial_id="d", rung=2, value=0.7) is True  # >= 0.65


def test_the_stop_signal_survives_pickling() -> None:
    import pickle

    again = pickle.loads(pickle.dumps(TrialPruned(rung=2, value=0.25)))
    assert (again.rung, again.value) == (2, 0.25) and "epoch 2" in str(again)


def test_a_rerun_is_never_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-run is one more seed of a finished trial: it runs to its last epoch, whatever the
    pruner's board says (a full-size sweep lost all four of its re-runs at a rung before)."""
    from dpsweep.orchestrator.sweep import jobs
    from dpsweep.orchestrator.trial import runner

    seen: list[dict] = []
    monkeypatch.setattr(runner, "execute",
                        lambda config, audit, **_: seen.append(config) or {})
    config = {"trial_id": "dpsgd_eps3-000-r1", "spec": {}, "audit": {"in_trial": False},
              "pruning": {"actor": object(), "study": "dpsgd@eps3", "rungs": [5, 15]}}
    jobs.rerun_job(config=config)
    assert len(seen) == 1 and "pruning" not in seen[0]
    assert seen[0]["trial_id"] == "dpsgd_eps3-000-r1"
    assert "pruning" in config  # the caller's config is not changed


@pytest.mark.parametrize(("row", "retry", "pending"), [
    (None, False, True), (None, True, True),
    ({"status": "ok"}, False, False), ({"status": "ok"}, True, False),
    ({"status": "failed"}, False, False), ({"status": "failed"}, True, True),
])
def test_failed_reruns_are_trained_again_only_when_asked(row: dict | None, retry: bool,
                                                          pending: bool) -> None:
    from dpsweep.orchestrator.sweep.jobs import rerun_pending

    assert rerun_pending(row, retry_failed=retry) is pending
