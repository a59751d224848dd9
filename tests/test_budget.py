"""Budget matching with the real accountants: the numbers a sweep will train with.

The expensive PRV calibrations are module-scoped fixtures shared by the tests that only read
them, so the file stays well under a minute and a half on two cores.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import UserInputError
from orchestrator import budget
from orchestrator.budget import (
    Calibration,
    EpsilonBounds,
    Phase,
    calibrate,
    default_cache_dir,
    epsilon_curve,
    prv_epsilon,
    rdp_epsilon,
)

Q, T, DELTA = 0.004267, 2344, 1e-5
# A cheap question (about a second of PRV) for tests that need fresh calibrations.
CHEAP: dict[str, Any] = {"target_epsilon": 2.0, "delta": DELTA, "sample_rate": 0.02, "steps": 250}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("budget")


@pytest.fixture(scope="module")
def acceptance(cache: Path) -> Calibration:
    return calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, cache_dir=cache)


def test_acceptance_numbers(acceptance: Calibration) -> None:
    cal = acceptance
    assert cal.accountant == "prv" and cal.bounds.accountant == "prv"
    assert cal.fallback_reason is None and not cal.cached
    assert 0.690 <= cal.noise_multiplier <= 0.705
    assert 2.97 <= cal.bounds.upper <= 3.0
    assert cal.bounds.lower is not None and cal.bounds.estimate is not None
    assert cal.bounds.lower <= cal.bounds.estimate <= cal.bounds.upper
    assert cal.schedule == (Phase(noise_multiplier=cal.scale, steps=T),)
    assert cal.steps == T and cal.eps_error == pytest.approx(0.006)
    assert cal.seconds > 0


def test_cached_call_is_fast_and_identical(acceptance: Calibration, cache: Path) -> None:
    t0 = time.perf_counter()
    again = calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, cache_dir=cache)
    assert time.perf_counter() - t0 < 0.5
    assert again.cached
    assert again.schedule == acceptance.schedule and again.bounds == acceptance.bounds
    assert again.seconds == acceptance.seconds  # the original compute time, not the lookup's
    # What another process sees: the file alone, without this process's memory.
    budget._MEMORY.clear()
    t0 = time.perf_counter()
    from_disk = calibrate(target_epsilon=3.0, delta=DELTA, sample_rate=Q, steps=T, cache_dir=cache)
    assert time.perf_counter() - t0 < 0.5
    assert from_disk.cached and from_disk.schedule == acceptance.schedule


def test_corrupt_cache_file_is_recomputed(tmp_path: Path) -> None:
    first = calibrate(**CHEAP, cache_dir=tmp_path)
    (path,) = tmp_path.glob("calibration-*.json")
    path.write_text('{"schema": 1, "calibr')
    second = calibrate(**CHEAP, cache_dir=tmp_path)
    assert not second.cached and second.accountant == "prv"
    assert second.schedule == first.schedule  # the computation is deterministic
    assert json.loads(path.read_text())["calibration"]["accountant"] == "prv"
    assert not list(tmp_path.glob(".tmp-*"))  # atomic writes leave no temp files
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
    schedule = [Phase(0.7, T)]
    prv = prv_epsilon(schedule=schedule, sample_rate=Q, delta=DELTA, eps_error=0.01)
    rdp = rdp_epsilon(schedule=schedule, sample_rate=Q, delta=DELTA)
    assert prv.upper == pytest.approx(2.92, abs=0.01)
    assert rdp.upper == pytest.approx(3.59, abs=0.01)


def test_upper_epsilon_strictly_decreasing_in_sigma() -> None:
    sigmas = [0.6, 0.7, 0.85, 1.0, 1.3, 2.0]
    uppers = [prv_epsilon(schedule=[Phase(s, T)], sample_rate=Q, delta=DELTA,
                          eps_error=0.05).upper for s in sigmas]
    assert all(a > b for a, b in itertools.pairwise(uppers))
    rdps = [rdp_epsilon(schedule=[Phase(s, T)], sample_rate=Q, delta=DELTA).upper
            for s in sigmas]
    assert all(a > b for a, b in itertools.pairwise(rdps))


def test_decaying_schedule(cache: Path) -> None:
    q, target, per_phase = 0.02, 2.0, 100
    shape = [Phase(noise_multiplier=1 / (1 + 0.1 * t), steps=per_phase) for t in range(5)]
    cal = calibrate(target_epsilon=target, delta=DELTA, sample_rate=q, shape=shape,
                    cache_dir=cache)
    assert cal.accountant == "prv"
    assert 0.99 * target <= cal.bounds.upper <= target
    assert cal.steps == 5 * per_phase
    for got, want in zip(cal.schedule, shape, strict=True):
        assert got.steps == want.steps
        assert got.noise_multiplier == pytest.approx(cal.scale * want.noise_multiplier, rel=1e-12)
    constant = calibrate(target_epsilon=target, delta=DELTA, sample_rate=q,
                         steps=5 * per_phase, cache_dir=cache)
    # Less noise late must be paid for with more noise early.
    assert cal.noise_multiplier > constant.noise_multiplier > cal.schedule[-1].noise_multiplier
    again = prv_epsilon(schedule=cal.schedule, sample_rate=q, delta=DELTA,
                        eps_error=cal.eps_error)
    assert again.upper == pytest.approx(cal.bounds.upper, abs=1e-9)
    assert again.upper <= target


def test_timeout_falls_back_to_rdp(tmp_path: Path) -> None:
    cal = calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, timeout_s=0.01,
                    cache_dir=tmp_path)
    assert cal.accountant == "rdp" and cal.bounds.accountant == "rdp"
    assert cal.fallback_reason is not None
    assert "did not finish within 0.01 s" in cal.fallback_reason
    assert cal.bounds.lower is None and cal.bounds.estimate is None
    assert 2.97 <= cal.bounds.upper <= 3.0
    assert rdp_epsilon(schedule=cal.schedule, sample_rate=Q, delta=DELTA).upper == cal.bounds.upper
    assert cal.noise_multiplier > 0.705  # RDP is looser, so it asks for more noise
    curve = epsilon_curve(cal, at_steps=[1000, T], cache_dir=tmp_path)
    assert [b.accountant for b in curve] == ["rdp", "rdp"]
    assert curve[0].upper < curve[1].upper == cal.bounds.upper
    # The same question with the same time bound is answered from the cache.
    assert calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, timeout_s=0.01,
                     cache_dir=tmp_path).cached


def test_cached_timeout_is_retried_with_more_time(tmp_path: Path) -> None:
    assert calibrate(**CHEAP, timeout_s=0.01, cache_dir=tmp_path).accountant == "rdp"
    retried = calibrate(**CHEAP, cache_dir=tmp_path)
    assert retried.accountant == "prv" and not retried.cached
    assert calibrate(**CHEAP, timeout_s=0.01, cache_dir=tmp_path).accountant == "prv"


def test_prv_exception_falls_back_to_rdp(tmp_path: Path) -> None:
    # prv-accountant refuses deltas this small (floating-point error would dominate).
    cal = calibrate(target_epsilon=3, delta=1e-16, sample_rate=Q, steps=T, cache_dir=tmp_path)
    assert cal.accountant == "rdp"
    assert cal.fallback_reason is not None and "Floating point errors" in cal.fallback_reason
    assert 2.97 <= cal.bounds.upper <= 3.0


def test_epsilon_curve_per_epoch(acceptance: Calibration, cache: Path) -> None:
    at = [235 * k for k in range(1, 10)] + [T]
    curve = epsilon_curve(acceptance, at_steps=at, cache_dir=cache)
    assert len(curve) == len(at) and all(b.accountant == "prv" for b in curve)
    uppers = [b.upper for b in curve]
    assert all(a < b for a, b in itertools.pairwise(uppers))
    assert uppers[-1] == pytest.approx(acceptance.bounds.upper, abs=acceptance.eps_error)
    assert uppers[-1] <= acceptance.target_epsilon
    t0 = time.perf_counter()
    assert epsilon_curve(acceptance, at_steps=at, cache_dir=cache) == curve
    assert time.perf_counter() - t0 < 0.5
    assert len(list(cache.glob("curve-*.json"))) == 1


def test_epsilon_curve_across_phases(tmp_path: Path) -> None:
    shape = [Phase(1.0, 100), Phase(0.8, 150)]
    cal = calibrate(target_epsilon=2.0, delta=DELTA, sample_rate=0.02, shape=shape,
                    cache_dir=tmp_path)
    curve = epsilon_curve(cal, at_steps=[50, 100, 175, 250], cache_dir=tmp_path)
    uppers = [b.upper for b in curve]
    assert all(a < b for a, b in itertools.pairwise(uppers))
    assert uppers[-1] == pytest.approx(cal.bounds.upper, abs=cal.eps_error)
    # The prefix through phase 1 is that phase alone (up to discretisation error).
    alone = prv_epsilon(schedule=cal.schedule[:1], sample_rate=0.02, delta=DELTA,
                        eps_error=cal.eps_error)
    assert uppers[1] == pytest.approx(alone.upper, abs=2 * cal.eps_error)


def test_round_trip_through_json(acceptance: Calibration) -> None:
    d = json.loads(json.dumps(acceptance.to_dict()))
    assert Calibration.from_dict(d) == acceptance
    rdp = Calibration(target_epsilon=1.0, delta=1e-6, sample_rate=0.5,
                      schedule=(Phase(3.0, 10), Phase(2.0, 5)), scale=3.0,
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
        ({"steps": None, "shape": [Phase(1.0, 10), Phase(-0.5, 10)]}, "schedule"),
        ({"steps": None, "shape": [Phase(math.nan, 10)]}, "schedule"),
        ({"steps": None, "shape": [Phase(1.0, 0)]}, "schedule"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_calibrate_inputs(change: dict[str, Any], field: str, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(UserInputError) as info:
        calibrate(**{**GOOD, **change}, cache_dir=tmp_path)
    assert info.value.field == field
    assert time.perf_counter() - t0 < 0.5  # validated before any accounting
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

    u, e, _, n = budget._search(eps, u0=u_true + offset, slope=slope_guess, lo=0.99 * target,
                                hi=target, u_min=u_true - 4, u_max=u_true + 4,
                                max_step=math.log(1.5), max_evals=40)
    assert 0.99 * target <= e <= target and e == eps(u)
    assert n <= 12
