"""Budget matching with the real accountants: the numbers a sweep will train with.

The float64 PRV grid is checked against prv-accountant itself, calibrations and cache hits against
dp_accounting's PLD (an accountant that shares no code with it), tampered cache entries must be
refused. Expensive calibrations are module-scoped fixtures shared by the tests that only read them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpsweep.core.errors import UserInputError
from dpsweep.core.events import (
    Composed,
    Gaussian,
    PoissonSubsampledGaussian,
    RepeatAndSelect,
    event_from_dict,
    events_from_list,
    events_to_list,
)
from dpsweep.core.schedule import Phase, Schedule
from dpsweep.core.trial import Calibration, EpsilonBounds
from dpsweep.orchestrator.accounting import cache as budget_cache
from dpsweep.orchestrator.accounting import calibration as curves
from dpsweep.orchestrator.accounting import search
from dpsweep.orchestrator.accounting.cache import default_cache_dir
from dpsweep.orchestrator.accounting.calibration import calibrate, epsilon_curve
from dpsweep.orchestrator.accounting.certificate import WINDOW
from dpsweep.orchestrator.accounting.prv import prv_epsilon, rdp_integer_epsilon
from dpsweep.orchestrator.accounting.verify import (
    _one_step_epsilon,
    epsilon_of_events,
    rdp_epsilon,
    schedule_events,
    verify_calibration,
)

Q, T, DELTA = 0.004267, 2344, 1e-5
#: sigma of the acceptance question whose fine PRV upper bound is the window's centre, found by
#: bisection on prv_epsilon (eps_error 0.006): printed rounded up, it reads 0.6952.
CENTRE_SIGMA = 0.695173


# A cheap question (a fraction of a second of PRV) for tests that need fresh calibrations.
CHEAP: dict[str, Any] = {"target_epsilon": 2.0, "delta": DELTA, "sample_rate": 0.02, "steps": 250}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("budget")


@pytest.fixture(scope="module")
def acceptance(cache: Path) -> Calibration:
    return calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, cache_dir=cache)


def _entry_path(cache: Path, sample_rate: float = Q) -> Path:
    """The cache file of the question with this sample rate (others may share the directory)."""
    (path,) = [p for p in (cache / budget_cache.CACHE_NAMESPACE).glob("*.json")
               if json.loads(p.read_text())["key"]["sample_rate"] == repr(sample_rate)]
    return path


def test_acceptance_numbers(acceptance: Calibration) -> None:
    cal = acceptance
    assert cal.accountant == "prv" and cal.bounds.accountant == "prv"
    assert cal.fallback_reason is None and not cal.cached
    centre = math.sqrt(WINDOW) * 3.0
    # One fine composition certifies the coarse aim: upper bound at the centre, not just inside.
    assert abs(cal.bounds.upper / centre - 1) < 1e-4
    assert cal.noise_multiplier == pytest.approx(CENTRE_SIGMA, abs=2e-6)
    assert cal.bounds.lower is not None and cal.bounds.estimate is not None
    assert cal.bounds.lower <= cal.bounds.estimate <= cal.bounds.upper <= 3.0
    assert cal.schedule == Schedule.constant(noise_multiplier=cal.scale, steps=T)
    assert cal.steps == T and cal.eps_error == pytest.approx(0.006)
    assert cal.seconds > 0


def test_float64_grid_matches_prv_accountant() -> None:
    """Same algorithm as prv-accountant 0.2.0 (which computes in long double)."""
    import numpy as np
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    cases = [([0.6953], [T], Q, 0.1), ([1.2, 0.9], [100, 150], 0.02, 0.05)]
    for sigmas, steps, q, err in cases:
        prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=s)
                for s in sigmas]
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = PRVAccountant(prvs=prvs, max_self_compositions=steps, eps_error=err,
                                delta_error=DELTA * 1e-3).compute_epsilon(
                delta=DELTA, num_self_compositions=steps)
        ours = prv_epsilon(schedule=[Phase(s, n) for s, n in zip(sigmas, steps, strict=True)],
                           sample_rate=q, delta=DELTA, eps_error=err)
        assert (ours.lower, ours.estimate, ours.upper) == pytest.approx(ref, abs=1e-7)


def test_one_step_closed_form_matches_the_grid() -> None:
    for sigma, q in [(0.7, Q), (1.0, 0.1), (0.5, 1.0)]:
        grid = prv_epsilon(schedule=[Phase(sigma, 1)], sample_rate=q, delta=DELTA,
                           eps_error=1e-3)
        exact = _one_step_epsilon(sample_rate=q, sigma=sigma, delta=DELTA)
        assert grid.lower <= exact <= grid.upper
        assert exact == pytest.approx(grid.estimate, abs=1e-4)


def test_independent_pld_confirms_the_calibration(acceptance: Calibration) -> None:
    events = schedule_events(acceptance.schedule, sample_rate=Q)
    assert events == [PoissonSubsampledGaussian(sampling_probability=Q,
                                                noise_multiplier=acceptance.scale, count=T)]
    pld = epsilon_of_events(events, delta=DELTA, accountant="pld")
    b = acceptance.bounds
    assert b.lower <= pld <= b.upper  # PLD (pessimistic) within PRV's certified interval
    assert pld == pytest.approx(b.estimate, abs=2e-3)
    check = verify_calibration(acceptance)
    assert check.pld_epsilon <= b.upper + check.pld_error
    assert 0 < check.pld_error < 0.015 * 3.0  # the stated error: about 1% of the target
    assert check.one_step_epsilon < b.lower


def _never(*_: object, **__: object) -> None:
    raise AssertionError("the accountant ran for a calibration verified in this process")


def test_cached_call_is_verified_and_identical(acceptance: Calibration, cache: Path) -> None:
    again = calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, cache_dir=cache)
    assert again.cached
    assert again.schedule == acceptance.schedule and again.bounds == acceptance.bounds
    assert again.seconds == acceptance.seconds  # the original compute time, not the lookup's
    # What another process sees: the file alone, verified by the independent accountant.
    budget_cache._VERIFIED.clear()
    from_disk = calibrate(target_epsilon=3.0, delta=DELTA, sample_rate=Q, steps=T,
                          cache_dir=cache)
    assert from_disk.cached and from_disk.schedule == acceptance.schedule
    assert len(budget_cache._VERIFIED) == 1
    # identical bytes, already verified in this process: not verified (nor computed) again
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budget_cache, "verify_calibration", _never)
        patch.setattr(curves, "prv_epsilon", _never)
        assert calibrate(target_epsilon=3.0, delta=DELTA, sample_rate=Q, steps=T,
                         cache_dir=cache).cached


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        ({"noise_multiplier": 0.05}, "not scale x the requested shape"),
        ({"noise_multiplier": 0.05, "scale": 0.05}, "one step at noise 0.05"),
        ({"noise_multiplier": 0.6, "scale": 0.6}, "dp_accounting's PLD gives epsilon"),
        ({"lower": 2.99, "estimate": 2.995, "upper": 2.9999},
         "below the claimed PRV lower bound"),
        ({"target_epsilon": 4.0}, "target_epsilon"),
    ],
)
def test_tampered_cache_entry_is_ignored_and_recomputed(
        acceptance: Calibration, cache: Path, tmp_path: Path, edit: dict[str, float], why: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A tampered entry is never trained with: ignored (logged, naming the file and the
    contradiction), the answer recomputed and written over it."""
    entry = json.loads(_entry_path(cache).read_text())
    target_dir = tmp_path / budget_cache.CACHE_NAMESPACE
    target_dir.mkdir()
    path = target_dir / _entry_path(cache).name
    cal = entry["value"]["calibration"]
    for name, value in edit.items():
        if name == "noise_multiplier":
            cal["schedule"][0]["noise_multiplier"] = value
        elif name in ("lower", "estimate", "upper"):
            cal["bounds"][name] = value
        else:
            cal[name] = value
    path.write_text(json.dumps(entry))
    budget_cache._VERIFIED.clear()
    with caplog.at_level(logging.WARNING):
        cal = calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T,
                        cache_dir=tmp_path)
    assert not cal.cached and cal.schedule == acceptance.schedule
    logged = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert logged and why in logged[0]
    rewritten = json.loads(path.read_text())["value"]["calibration"]
    assert rewritten["bounds"]["upper"] == acceptance.bounds.upper
    assert calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T,
                     cache_dir=tmp_path).cached


def test_untampered_copy_passes(acceptance: Calibration, cache: Path, tmp_path: Path) -> None:
    (tmp_path / budget_cache.CACHE_NAMESPACE).mkdir()
    path = tmp_path / budget_cache.CACHE_NAMESPACE / _entry_path(cache).name
    path.write_text(_entry_path(cache).read_text())
    budget_cache._VERIFIED.clear()
    cal = calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, cache_dir=tmp_path)
    assert cal.cached and cal.schedule == acceptance.schedule


def test_corrupt_cache_file_is_recomputed(tmp_path: Path) -> None:
    first = calibrate(**CHEAP, cache_dir=tmp_path)
    path = _entry_path(tmp_path, CHEAP["sample_rate"])
    path.write_text('{"key": {"schema": 2, "calibr')
    second = calibrate(**CHEAP, cache_dir=tmp_path)
    assert not second.cached and second.accountant == "prv"
    assert second.schedule == first.schedule  # the computation is deterministic
    assert json.loads(path.read_text())["value"]["calibration"]["accountant"] == "prv"
    assert not list(path.parent.glob(".tmp-*"))  # atomic writes leave no temp files
    assert calibrate(**CHEAP, cache_dir=tmp_path).cached


def test_use_cache_false_bypasses_the_cache(tmp_path: Path) -> None:
    cal = calibrate(**CHEAP, cache_dir=tmp_path, use_cache=False)
    assert not cal.cached and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("sample_rate", "schedule"),
    [
        (Q, [Phase(0.7, T)]),
        (0.01, [Phase(1.0, 1000)]),
        (0.1, [Phase(2.0, 100)]),
        (0.02, [Phase(1.2, 100), Phase(0.9, 150)]),
    ],
)
def test_rdp_is_never_tighter_than_prv(sample_rate: float, schedule: list[Phase]) -> None:
    err = 0.01
    prv = prv_epsilon(schedule=schedule, sample_rate=sample_rate, delta=DELTA, eps_error=err)
    rdp = rdp_epsilon(schedule=schedule, sample_rate=sample_rate, delta=DELTA)
    assert prv.accountant == "prv" and rdp.accountant == "rdp"
    assert prv.lower is not None and prv.estimate is not None
    assert prv.lower <= prv.estimate <= prv.upper
    assert prv.upper - prv.lower <= 2 * err + 1e-3
    assert rdp.lower is None and rdp.estimate is None
    assert rdp.upper >= prv.upper - err


def test_reference_numbers_at_sigma_07() -> None:
    schedule = Schedule.constant(noise_multiplier=0.7, steps=T)
    prv = prv_epsilon(schedule=schedule, sample_rate=Q, delta=DELTA, eps_error=0.01)
    rdp = rdp_epsilon(schedule=schedule, sample_rate=Q, delta=DELTA)
    assert prv.upper == pytest.approx(2.92, abs=0.01)
    assert rdp.upper == pytest.approx(3.59, abs=0.01)


def test_upper_epsilon_strictly_decreasing_in_sigma() -> None:
    sigmas = [0.6, 0.7, 0.85, 1.0, 1.3, 2.0]
    uppers = [prv_epsilon(schedule=[Phase(s, T)], sample_rate=Q, delta=DELTA,
                          eps_error=0.05).upper for s in sigmas]
    assert all(a > b for a, b in itertools.pairwise(uppers))
    rdps = [rdp_integer_epsilon(sigmas=[s], steps=[T], sample_rate=Q, delta=DELTA)
            for s in sigmas]
    assert all(a > b for a, b in itertools.pairwise(rdps))


def test_decaying_schedule(cache: Path) -> None:
    q, target, per_phase = 0.02, 2.0, 100
    shape = Schedule(tuple(Phase(noise_multiplier=1 / (1 + 0.1 * t), steps=per_phase)
                           for t in range(5)))
    cal = calibrate(target_epsilon=target, delta=DELTA, sample_rate=q, shape=shape,
                    cache_dir=cache)
    assert cal.accountant == "prv"
    assert 0.99 * target <= cal.bounds.upper <= target
    assert cal.steps == 5 * per_phase
    for got, want in zip(cal.schedule.phases, shape.phases, strict=True):
        assert got.steps == want.steps
        assert got.noise_multiplier == pytest.approx(cal.scale * want.noise_multiplier, rel=1e-12)
    constant = calibrate(target_epsilon=target, delta=DELTA, sample_rate=q,
                         steps=5 * per_phase, cache_dir=cache)
    # Less noise late must be paid for with more noise early.
    last = cal.schedule.phases[-1].noise_multiplier
    assert cal.noise_multiplier > constant.noise_multiplier > last
    again = prv_epsilon(schedule=cal.schedule, sample_rate=q, delta=DELTA,
                        eps_error=cal.eps_error)
    assert again.upper == pytest.approx(cal.bounds.upper, abs=1e-9)
    verify_calibration(cal)  # the heterogeneous schedule passes the independent check too


def test_a_curve_asked_again_is_looked_up_not_recomposed(
        acceptance: Calibration, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver asks for the same schedule's curve once per trial."""
    at = [T // 4, T // 2, T]
    curves._CURVES.clear()
    composed: list[int] = []
    original = curves._prv_curve
    monkeypatch.setattr(curves, "_prv_curve",
                        lambda cal, ks: composed.append(len(ks)) or original(cal, ks))
    first = epsilon_curve(acceptance, at_steps=at)
    again = epsilon_curve(acceptance, at_steps=list(reversed(at)))
    assert composed == [3] and again == list(reversed(first))
    # anything the curve depends on is part of the key: another target is composed afresh
    other = dataclasses.replace(acceptance, bounds=dataclasses.replace(
        acceptance.bounds, upper=acceptance.bounds.upper - 0.5))
    capped = epsilon_curve(other, at_steps=at)
    assert composed == [3, 3] and capped[-1] == other.bounds
    assert max(b.upper for b in capped) <= other.bounds.upper


def test_prv_exception_falls_back_to_rdp(tmp_path: Path) -> None:
    # In float64 the PRV refuses deltas this small (floating-point error would dominate).
    cal = calibrate(target_epsilon=3, delta=1e-16, sample_rate=Q, steps=T, cache_dir=tmp_path)
    assert cal.accountant == "rdp"
    assert cal.fallback_reason is not None and "Floating point errors" in cal.fallback_reason
    assert 2.97 <= cal.bounds.upper <= 3.0


def test_epsilon_curve_per_epoch(acceptance: Calibration) -> None:
    epoch = T // 20
    at = [epoch * k for k in range(1, 20)] + [T]
    curves._CURVES.clear()  # time a composition, not a lookup of another test's curve
    cpu = time.process_time()
    curve = epsilon_curve(acceptance, at_steps=at)
    cpu = time.process_time() - cpu
    assert cpu < 2.0  # about 0.9 s of CPU here; today's fine PRV took ~10 s for this curve
    assert len(curve) == len(at) and all(b.accountant == "prv" for b in curve)
    uppers = [b.upper for b in curve]
    assert all(a < b for a, b in itertools.pairwise(uppers))
    assert curve[-1] == acceptance.bounds  # the last point is the certificate itself
    # An intermediate point against a fresh PRV of that prefix (its own grid).
    prefix = prv_epsilon(schedule=acceptance.schedule.prefix(at[9]), sample_rate=Q, delta=DELTA,
                         eps_error=acceptance.eps_error)
    assert curve[9].estimate == pytest.approx(prefix.estimate, abs=1e-4)
    assert curve[9].upper <= prefix.upper + 1e-4


def test_epsilon_curve_across_phases(tmp_path: Path) -> None:
    shape = [Phase(1.0, 100), Phase(0.8, 150)]
    cal = calibrate(target_epsilon=2.0, delta=DELTA, sample_rate=0.02, shape=shape,
                    cache_dir=tmp_path)
    curve = epsilon_curve(cal, at_steps=[50, 100, 175, 250])
    uppers = [b.upper for b in curve]
    assert all(a < b for a, b in itertools.pairwise(uppers))
    assert curve[-1] == cal.bounds
    # The prefix through phase 1 is that phase alone (up to discretisation error).
    alone = prv_epsilon(schedule=cal.schedule.prefix(100), sample_rate=0.02, delta=DELTA,
                        eps_error=cal.eps_error)
    assert uppers[1] == pytest.approx(alone.upper, abs=2 * cal.eps_error)


def test_events_round_trip_and_accounting() -> None:
    train = PoissonSubsampledGaussian(sampling_probability=0.01, noise_multiplier=1.1, count=500)
    score = Gaussian(noise_multiplier=20.0)
    tuned = RepeatAndSelect(event=Composed((train, score)), mean=8.0)
    tnb = RepeatAndSelect(event=train, mean=4.0, shape=1.0)
    for e in (train, score, tuned, tnb):
        assert event_from_dict(json.loads(json.dumps(e.to_dict()))) == e
    assert events_from_list(json.loads(json.dumps(events_to_list([train, tuned])))) == [train,
                                                                                         tuned]
    assert tuned.to_dict()["shape"] is None  # Poisson: dp_accounting's shape=inf, JSON-safe
    # The same events, built directly in dp_accounting.
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_event.RepeatAndSelectDpEvent(dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(
            0.01, dp_event.GaussianDpEvent(1.1)), 500),
        dp_event.GaussianDpEvent(20.0)]), 8.0, math.inf))
    assert epsilon_of_events(tuned, delta=DELTA, accountant="rdp") == acc.get_epsilon(DELTA)
    alone = epsilon_of_events([train, score], delta=DELTA, accountant="rdp")
    assert epsilon_of_events(tuned, delta=DELTA, accountant="rdp") > alone
    with pytest.raises(UserInputError) as info:
        epsilon_of_events(tuned, delta=DELTA, accountant="pld")
    assert info.value.field == "accountant"
    for bad, field in [({"kind": "laplace"}, "event.kind"),
                       ({"kind": "gaussian", "noise_multiplier": -1.0}, "event.noise_multiplier"),
                       ({"kind": "gaussian", "noise_multiplier": 1.0, "count": 0}, "event.count"),
                       ({"kind": "repeat_and_select", "event": score.to_dict(), "mean": 0.5},
                        "event.mean"),
                       ({"kind": "composed", "events": []}, "event.events")]:
        with pytest.raises(UserInputError) as info:
            event_from_dict(bad)
        assert info.value.field == field


def test_round_trip_through_json(acceptance: Calibration) -> None:
    d = json.loads(json.dumps(acceptance.to_dict()))
    assert Calibration.from_dict(d) == acceptance
    assert d["schedule"] == [{"noise_multiplier": acceptance.scale, "steps": T}]
    rdp = Calibration(target_epsilon=1.0, delta=1e-6, sample_rate=0.5,
                      schedule=Schedule((Phase(3.0, 10), Phase(2.0, 5))), scale=3.0,
                      bounds=EpsilonBounds(lower=None, estimate=None, upper=0.995,
                                           accountant="rdp"),
                      accountant="rdp", fallback_reason="why", eps_error=0.002, seconds=0.1,
                      cached=True)
    assert Calibration.from_dict(json.loads(json.dumps(rdp.to_dict()))) == rdp
    assert rdp.noise_multiplier == 3.0 and rdp.steps == 15
    with pytest.raises(UserInputError) as info:
        Calibration.from_dict({"schedule": []})
    assert info.value.field == "calibration"


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DPSWEEP_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DPSWEEP_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "dpsweep" / "budget"


GOOD: dict[str, Any] = {"target_epsilon": 3.0, "delta": DELTA, "sample_rate": Q, "steps": T}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"target_epsilon": 0}, "privacy.epsilon"),
        ({"target_epsilon": -1.0}, "privacy.epsilon"),
        ({"target_epsilon": math.nan}, "privacy.epsilon"),
        ({"target_epsilon": math.inf}, "privacy.epsilon"),
        ({"target_epsilon": 1e6}, "privacy.epsilon"),
        ({"delta": 0.0}, "privacy.delta"),
        ({"delta": 1.0}, "privacy.delta"),
        ({"delta": math.nan}, "privacy.delta"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"sample_rate": math.nan}, "sample_rate"),
        ({"steps": 0}, "steps"),
        ({"steps": -5}, "steps"),
        ({"steps": 10.5}, "steps"),
        ({"steps": None}, "steps"),  # neither steps nor shape
        ({"shape": [Phase(1.0, 10)]}, "steps"),  # both
        ({"steps": None, "shape": []}, "schedule"),
        ({"steps": None, "shape": [Phase(1.0, 10), Phase(-0.5, 10)]}, "schedule[1]"),
        ({"steps": None, "shape": [Phase(math.nan, 10)]}, "schedule[0]"),
        ({"steps": None, "shape": [Phase(1.0, 0)]}, "schedule[0]"),
        ({"steps": None, "shape": [(1.0, 10)]}, "shape[0]"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": math.nan}, "timeout_s"),
    ],
)
def test_bad_calibrate_inputs(change: dict[str, Any], field: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    def accounted(*_a: object, **_k: object) -> None:
        raise AssertionError("the accountant ran: not validated before any accounting")

    for name in ("prv_in_child", "rdp_calibrate", "lookup"):  # no wall clock: no load matters
        monkeypatch.setattr(curves, name, accounted)
    with pytest.raises(UserInputError) as info:
        calibrate(**{**GOOD, **change}, cache_dir=tmp_path)
    assert info.value.field == field
    assert not list(tmp_path.iterdir())


def test_bad_accountant_inputs(acceptance: Calibration) -> None:
    with pytest.raises(UserInputError) as info:
        prv_epsilon(schedule=[], sample_rate=Q, delta=DELTA)
    assert info.value.field == "schedule"
    with pytest.raises(UserInputError) as info:
        rdp_epsilon(schedule=[Phase(1.0, 10)], sample_rate=2.0, delta=DELTA)
    assert info.value.field == "sample_rate"
    with pytest.raises(UserInputError) as info:
        prv_epsilon(schedule=[Phase(1.0, 10)], sample_rate=Q, delta=0.0)
    assert info.value.field == "privacy.delta"
    with pytest.raises(UserInputError) as info:
        epsilon_of_events([], delta=DELTA)
    assert info.value.field == "events"
    for bad in ([0], [T + 1], [1.5]):
        with pytest.raises(UserInputError) as info:
            epsilon_curve(acceptance, at_steps=bad)
        assert info.value.field == "at_steps"


@settings(max_examples=60, deadline=None)
@given(k=st.floats(0.3, 8.0), u_true=st.floats(-4.0, 4.0), offset=st.floats(-1.2, 1.2),
       slope_guess=st.floats(0.2, 10.0))
def test_search_finds_the_window_quickly(k: float, u_true: float, offset: float,
                                         slope_guess: float) -> None:
    """Monotone, nearly log-log-linear curves (like epsilon(scale)) from a rough start."""
    target = 3.0

    def eps(u: float) -> float:
        return target * math.exp(-k * (u - u_true) + 0.05 * math.sin(3 * u))

    u, e, _, n = search._search(eps, u0=u_true + offset, slope=slope_guess, lo=0.99 * target,
                                hi=target, u_min=u_true - 4, u_max=u_true + 4,
                                max_step=math.log(1.5), max_evals=40)
    assert 0.99 * target <= e <= target and e == eps(u)
    assert n <= 12
