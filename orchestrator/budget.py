"""Privacy-budget matching: the noise schedule that spends exactly the sweep's (epsilon, delta).

Every trial of a sweep is held to one target, so the noise multiplier is calibrated here, once
per distinct question, with the PRV accountant (tight numerical composition, with certified
error bars) and cached on disk for the many trial processes that ask the same question. PRV
can be slow or numerically fragile at small noise, so it runs in a child process under a time
bound; when it fails, the looser but robust Opacus RDP accountant calibrates instead and the
result says so.

Calibration searches over a single factor ``scale`` applied to a requested shape (relative
noise multipliers per phase), because upper epsilon is monotone in that factor and nearly a
straight line in log-log space, which makes a safeguarded secant search converge in a couple
of evaluations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing
import operator
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import UserInputError

__all__ = [
    "Calibration",
    "EpsilonBounds",
    "Phase",
    "calibrate",
    "default_cache_dir",
    "epsilon_curve",
    "prv_epsilon",
    "rdp_epsilon",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Bump when the cache's meaning changes, so stale answers are never served."""

RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10 for x in range(1, 100)] + list(range(12, 64)))
"""Opacus's default orders, so RDP numbers here match what Opacus users see."""

WINDOW = 0.99
"""Calibrated upper epsilon lies in [WINDOW * target, target]: within 1% of the budget."""

DEFAULT_PRV_EPS_ERROR = 0.01
"""prv_epsilon's eps_error when none is given (calibrate derives its own from the target)."""

_DELTA_ERROR_FACTOR = 1e-3
_ENV_CACHE_DIR = "DPSWEEP_CACHE_DIR"

# Search settings. The PRV search never strays far from the RDP-calibrated scale (RDP is
# looser, so PRV's answer is a little below it); small sigma makes PRV slow and fragile.
_PRV_SCALE_BELOW_RDP = 4.0
_PRV_SCALE_ABOVE_RDP = 2.0
_COARSE_HALF_WIDTH = 0.0015  # coarse window: centre of the 1% window +- 0.15%
_RDP_SCALE_RANGE = (1e-4, 1e6)


# --------------------------------------------------------------------------------------------
# Data types


@dataclass(frozen=True)
class Phase:
    """A stretch of training at one noise multiplier (a shape entry is a relative multiplier)."""

    noise_multiplier: float
    steps: int


@dataclass(frozen=True)
class EpsilonBounds:
    """Epsilon of a schedule; RDP gives only an upper bound, so lower/estimate are None there."""

    lower: float | None
    estimate: float | None
    upper: float
    accountant: str

    def to_dict(self) -> dict[str, Any]:
        return {"lower": self.lower, "estimate": self.estimate, "upper": self.upper,
                "accountant": self.accountant}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpsilonBounds:
        def opt(v: Any) -> float | None:
            return None if v is None else float(v)

        accountant = str(d["accountant"])
        if accountant not in ("prv", "rdp"):
            raise ValueError(f"unknown accountant {accountant!r}")
        return cls(lower=opt(d["lower"]), estimate=opt(d["estimate"]), upper=float(d["upper"]),
                   accountant=accountant)


@dataclass(frozen=True)
class Calibration:
    """A matched budget: the schedule to train with and the accountant's certificate for it."""

    target_epsilon: float
    delta: float
    sample_rate: float
    schedule: tuple[Phase, ...]
    scale: float
    bounds: EpsilonBounds
    accountant: str
    fallback_reason: str | None
    eps_error: float
    seconds: float
    cached: bool

    @property
    def noise_multiplier(self) -> float:
        """The first phase's multiplier: sigma for a constant schedule, sigma_0 for a decay."""
        return self.schedule[0].noise_multiplier

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.schedule)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; trials receive this, and the cache stores it."""
        return {
            "schema": SCHEMA_VERSION,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "schedule": [{"noise_multiplier": p.noise_multiplier, "steps": p.steps}
                         for p in self.schedule],
            "scale": self.scale,
            "bounds": self.bounds.to_dict(),
            "accountant": self.accountant,
            "fallback_reason": self.fallback_reason,
            "eps_error": self.eps_error,
            "seconds": self.seconds,
            "cached": self.cached,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Inverse of to_dict; a malformed dict raises UserInputError(field="calibration")."""
        try:
            schedule = tuple(Phase(noise_multiplier=float(p["noise_multiplier"]),
                                   steps=operator.index(p["steps"])) for p in d["schedule"])
            accountant = str(d["accountant"])
            if accountant not in ("prv", "rdp") or not schedule:
                raise ValueError("accountant must be 'prv' or 'rdp' and the schedule non-empty")
            reason = d["fallback_reason"]
            return cls(
                target_epsilon=float(d["target_epsilon"]),
                delta=float(d["delta"]),
                sample_rate=float(d["sample_rate"]),
                schedule=schedule,
                scale=float(d["scale"]),
                bounds=EpsilonBounds.from_dict(d["bounds"]),
                accountant=accountant,
                fallback_reason=None if reason is None else str(reason),
                eps_error=float(d["eps_error"]),
                seconds=float(d["seconds"]),
                cached=bool(d.get("cached", False)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UserInputError(field="calibration", value=f"{type(exc).__name__}: {exc}",
                                 allowed="a dict produced by Calibration.to_dict()") from exc


# --------------------------------------------------------------------------------------------
# Validation (always before any computation)


def _finite_float(value: Any, *, field: str, allowed: str) -> float:
    if isinstance(value, bool):
        raise UserInputError(field=field, value=value, allowed=allowed)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UserInputError(field=field, value=value, allowed=allowed) from None
    if not math.isfinite(x):
        raise UserInputError(field=field, value=value, allowed=allowed)
    return x


def _check_epsilon(value: Any) -> float:
    allowed = "a finite number > 0"
    x = _finite_float(value, field="privacy.epsilon", allowed=allowed)
    if x <= 0:
        raise UserInputError(field="privacy.epsilon", value=value, allowed=allowed)
    return x


def _check_delta(value: Any) -> float:
    allowed = "a number in (0, 1)"
    x = _finite_float(value, field="privacy.delta", allowed=allowed)
    if not 0 < x < 1:
        raise UserInputError(field="privacy.delta", value=value, allowed=allowed)
    return x


def _check_sample_rate(value: Any) -> float:
    allowed = "a number in (0, 1]"
    x = _finite_float(value, field="sample_rate", allowed=allowed)
    if not 0 < x <= 1:
        raise UserInputError(field="sample_rate", value=value, allowed=allowed)
    return x


def _check_int(value: Any, *, field: str, low: int, allowed: str) -> int:
    if isinstance(value, bool):
        raise UserInputError(field=field, value=value, allowed=allowed)
    try:
        n = operator.index(value)
    except TypeError:
        raise UserInputError(field=field, value=value, allowed=allowed) from None
    if n < low:
        raise UserInputError(field=field, value=value, allowed=allowed)
    return n


def _check_schedule(schedule: Any) -> tuple[Phase, ...]:
    allowed = ("a non-empty sequence of Phase(noise_multiplier: finite > 0, steps: int >= 1)")
    if schedule is None or isinstance(schedule, (str, bytes)):
        raise UserInputError(field="schedule", value=schedule, allowed=allowed)
    try:
        phases = tuple(schedule)
    except TypeError:
        raise UserInputError(field="schedule", value=schedule, allowed=allowed) from None
    if not phases:
        raise UserInputError(field="schedule", value=schedule, allowed=allowed)
    out = []
    for i, p in enumerate(phases):
        if not isinstance(p, Phase):
            raise UserInputError(field="schedule", value=p, allowed=f"{allowed}; entry {i} is not")
        m = p.noise_multiplier
        ok_m = (not isinstance(m, bool) and isinstance(m, (int, float))
                and math.isfinite(m) and m > 0)
        try:
            ok_s = not isinstance(p.steps, bool) and operator.index(p.steps) >= 1
        except TypeError:
            ok_s = False
        if not (ok_m and ok_s):
            raise UserInputError(field="schedule", value=p, allowed=f"{allowed}; entry {i} is not")
        out.append(Phase(noise_multiplier=float(m), steps=operator.index(p.steps)))
    return tuple(out)


def _check_timeout(value: Any) -> float:
    allowed = "a number > 0 (seconds; inf for no bound)"
    if isinstance(value, bool):
        raise UserInputError(field="timeout_s", value=value, allowed=allowed)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UserInputError(field="timeout_s", value=value, allowed=allowed) from None
    if math.isnan(x) or x <= 0:
        raise UserInputError(field="timeout_s", value=value, allowed=allowed)
    return x


def _check_eps_error(value: Any) -> float:
    allowed = "a finite number > 0"
    x = _finite_float(value, field="eps_error", allowed=allowed)
    if x <= 0:
        raise UserInputError(field="eps_error", value=value, allowed=allowed)
    return x


# --------------------------------------------------------------------------------------------
# Accountants


def _prv_bounds(*, sigmas: Sequence[float], steps: Sequence[int], sample_rate: float,
                delta: float, eps_error: float) -> tuple[float, float, float]:
    """PRV (lower, estimate, upper); raises on anything that is not a usable certificate."""
    import numpy as np
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=sample_rate,
                                               noise_multiplier=s) for s in sigmas]
    # prv-accountant evaluates both branches of np.where, so overflow warnings are routine;
    # what matters is that the bounds that come out are finite and ordered (checked below).
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        acc = PRVAccountant(prvs=prvs, max_self_compositions=list(steps), eps_error=eps_error,
                            delta_error=delta * _DELTA_ERROR_FACTOR)
        lower, estimate, upper = acc.compute_epsilon(delta=delta,
                                                     num_self_compositions=list(steps))
    return _checked_triple(lower, estimate, upper)


def _checked_triple(lower: Any, estimate: Any, upper: Any) -> tuple[float, float, float]:
    lo, est, up = float(lower), float(estimate), float(upper)
    if not all(math.isfinite(v) for v in (lo, est, up)) or not lo <= est <= up:
        raise ArithmeticError(f"prv-accountant returned unusable epsilon bounds "
                              f"({lo!r}, {est!r}, {up!r})")
    return lo, est, up


def _rdp_upper(*, sigmas: Sequence[float], steps: Sequence[int], sample_rate: float,
               delta: float) -> float:
    # Imported lazily: opacus pulls in torch, which PRV-only callers (the child) never need.
    from opacus.accountants.analysis import rdp as opacus_rdp

    total: Any = 0.0
    for sigma, n in zip(sigmas, steps, strict=True):
        if n > 0:
            total = total + opacus_rdp.compute_rdp(q=sample_rate, noise_multiplier=sigma,
                                                   steps=n, orders=list(RDP_ORDERS))
    eps, _order = opacus_rdp.get_privacy_spent(orders=list(RDP_ORDERS), rdp=total, delta=delta)
    return float(eps)


def prv_epsilon(*, schedule: Sequence[Phase], sample_rate: float, delta: float,
                eps_error: float | None = None) -> EpsilonBounds:
    """PRV epsilon bounds of a schedule (heterogeneous composition, one mechanism per phase).

    Runs in-process without a time bound; eps_error defaults to 0.01 and delta_error is
    delta * 1e-3, as in calibrate.
    """
    phases = _check_schedule(schedule)
    q = _check_sample_rate(sample_rate)
    d = _check_delta(delta)
    err = DEFAULT_PRV_EPS_ERROR if eps_error is None else _check_eps_error(eps_error)
    lo, est, up = _prv_bounds(sigmas=[p.noise_multiplier for p in phases],
                              steps=[p.steps for p in phases], sample_rate=q, delta=d,
                              eps_error=err)
    return EpsilonBounds(lower=lo, estimate=est, upper=up, accountant="prv")


def rdp_epsilon(*, schedule: Sequence[Phase], sample_rate: float, delta: float) -> EpsilonBounds:
    """Opacus RDP upper bound of a schedule (phases' RDP curves add)."""
    phases = _check_schedule(schedule)
    q = _check_sample_rate(sample_rate)
    d = _check_delta(delta)
    up = _rdp_upper(sigmas=[p.noise_multiplier for p in phases],
                    steps=[p.steps for p in phases], sample_rate=q, delta=d)
    return EpsilonBounds(lower=None, estimate=None, upper=up, accountant="rdp")


# --------------------------------------------------------------------------------------------
# Search


class _SearchError(RuntimeError):
    """The window could not be reached within the allowed range or evaluation count."""


def _search(evaluate: Callable[[float], float], *, u0: float, slope: float, lo: float,
            hi: float, u_min: float, u_max: float, max_step: float,
            max_evals: int) -> tuple[float, float, float, int]:
    """Find u = log(scale) with lo <= evaluate(u) <= hi, for evaluate decreasing in u.

    log(epsilon) is close to linear in log(scale), so the search aims at the window's
    log-centre with secant steps; once the target is bracketed it switches to regula falsi
    with the Illinois modification, which cannot stall on one side. Steps before bracketing
    are capped at max_step and u stays in [u_min, u_max], so a bad slope guess can never send
    the accountant to tiny noise. Returns (u, epsilon, local slope, evaluations).
    """
    v_star = 0.5 * (math.log(lo) + math.log(hi))
    above: tuple[float, float] | None = None  # (u, f > 0): epsilon too high, u too small
    below: tuple[float, float] | None = None  # (u, f < 0): epsilon too low, u too large
    last_side = 0
    prev: tuple[float, float] | None = None
    u = min(max(u0, u_min), u_max)
    for n in range(1, max_evals + 1):
        eps = evaluate(u)
        if lo <= eps <= hi:
            return u, eps, slope, n
        f = math.log(eps) - v_star if 0 < eps < math.inf else (math.inf if eps > 0 else -math.inf)
        if prev is not None and math.isfinite(f) and math.isfinite(prev[1]) and u != prev[0]:
            s = -(f - prev[1]) / (u - prev[0])
            if math.isfinite(s) and s > 0:
                slope = min(max(s, 0.05), 50.0)
        prev = (u, f)
        if f > 0:
            if last_side == 1 and below is not None:
                below = (below[0], below[1] / 2)
            above, last_side = (u, f), 1
        else:
            if last_side == -1 and above is not None:
                above = (above[0], above[1] / 2)
            below, last_side = (u, f), -1
        if above is not None and below is not None:
            (ua, fa), (ub, fb) = above, below
            if ua >= ub:
                raise _SearchError("epsilon is not decreasing in the noise scale")
            if ub - ua < 1e-12:
                raise _SearchError(f"no scale gives epsilon in [{lo:.6g}, {hi:.6g}]; "
                                   "the accountant's error exceeds the window")
            u_next = ub - fb * (ub - ua) / (fb - fa) if math.isfinite(fa - fb) else math.nan
            if not ua < u_next < ub:
                u_next = 0.5 * (ua + ub)
        else:
            step = f / slope if math.isfinite(f) else math.copysign(max_step, f)
            u_next = u + min(max(step, -max_step), max_step)
            u_next = min(max(u_next, u_min), u_max)
            if u_next == u:
                raise _SearchError(f"epsilon {eps:.6g} at the edge of the search range "
                                   f"(scale {math.exp(u):.6g}); target window "
                                   f"[{lo:.6g}, {hi:.6g}] is out of reach")
        u = u_next
    raise _SearchError(f"no scale with epsilon in [{lo:.6g}, {hi:.6g}] after "
                       f"{max_evals} evaluations")


def _sigmas(u: float, multipliers: Sequence[float]) -> list[float]:
    scale = math.exp(u)
    return [scale * m for m in multipliers]


def _rdp_calibrate(*, multipliers: Sequence[float], steps: Sequence[int], sample_rate: float,
                   delta: float, target: float) -> tuple[float, float, float]:
    """RDP scale in the 1% window: PRV's starting point, and the fallback answer.

    Returns (log scale, RDP upper epsilon there, local log-log slope).
    """

    def evaluate(u: float) -> float:
        return _rdp_upper(sigmas=_sigmas(u, multipliers), steps=steps,
                          sample_rate=sample_rate, delta=delta)

    # Moments-accountant rule of thumb for the first guess; the search corrects it cheaply.
    total = sum(steps)
    guess = max(sample_rate * math.sqrt(2 * total * math.log(1 / delta)) / target, 1e-2)
    with warnings.catch_warnings():
        # Opacus warns when the optimal order is at the edge of its range; harmless here.
        warnings.simplefilter("ignore", UserWarning)
        u, eps, _, _ = _search(evaluate, u0=math.log(guess), slope=1.0, lo=WINDOW * target,
                               hi=target, u_min=math.log(_RDP_SCALE_RANGE[0]),
                               u_max=math.log(_RDP_SCALE_RANGE[1]), max_step=math.log(4.0),
                               max_evals=80)
        h = 0.02
        eps_h = evaluate(u + h)
    slope = (math.log(eps) - math.log(eps_h)) / h if 0 < eps_h < math.inf else math.nan
    return u, eps, (min(max(slope, 0.05), 50.0) if math.isfinite(slope) else 1.0)


def _prv_calibrate(*, multipliers: list[float], steps: list[int], sample_rate: float,
                   delta: float, target: float, eps_error: float, eps_coarse: float,
                   u_rdp: float, slope: float) -> dict[str, Any]:
    """PRV calibration: a cheap coarse search, then fine evaluations to certify the answer.

    The PRV estimate hardly depends on eps_error, but the cost grows like 1/eps_error, so the
    search runs at a coarse eps_error aiming the *fine* upper bound (coarse upper - coarse
    error + fine error) at the window's centre; usually one fine evaluation then certifies
    upper in [0.99 T, T]. The fine search continues from there if not.
    """
    u_min = u_rdp - math.log(_PRV_SCALE_BELOW_RDP)
    u_max = u_rdp + math.log(_PRV_SCALE_ABOVE_RDP)
    centre = math.sqrt(WINDOW) * target

    def coarse(u: float) -> float:
        _, _, up = _prv_bounds(sigmas=_sigmas(u, multipliers), steps=steps,
                               sample_rate=sample_rate, delta=delta, eps_error=eps_coarse)
        return up - eps_coarse + eps_error

    fine_bounds: dict[float, tuple[float, float, float]] = {}

    def fine(u: float) -> float:
        fine_bounds[u] = _prv_bounds(sigmas=_sigmas(u, multipliers), steps=steps,
                                     sample_rate=sample_rate, delta=delta, eps_error=eps_error)
        return fine_bounds[u][2]

    u0, n_coarse, step = u_rdp, 0, math.log(1.5)
    if eps_coarse > eps_error:
        try:
            u0, _, slope, n_coarse = _search(
                coarse, u0=u_rdp, slope=slope, lo=centre * (1 - _COARSE_HALF_WIDTH),
                hi=centre * (1 + _COARSE_HALF_WIDTH), u_min=u_min, u_max=u_max,
                max_step=math.log(1.5), max_evals=16)
            step = math.log(1.05)
        except _SearchError:
            pass  # only a head start; the fine search below decides
    u, _, _, n_fine = _search(fine, u0=u0, slope=slope, lo=WINDOW * target, hi=target,
                               u_min=u_min, u_max=u_max, max_step=step, max_evals=12)
    lower, estimate, upper = fine_bounds[u]
    return {"sigmas": _sigmas(u, multipliers), "scale": math.exp(u), "lower": lower,
            "estimate": estimate, "upper": upper, "coarse_evals": n_coarse,
            "fine_evals": n_fine}


def _prv_worker(conn: Any, job: dict[str, Any]) -> None:
    """Child-process entry point: every outcome, including errors, goes back as a message."""
    try:
        result = _prv_calibrate(**job)
        conn.send({"ok": True, "result": result})
    except Exception as exc:
        try:
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except Exception:
            pass
    finally:
        conn.close()


@dataclass(frozen=True)
class _ChildOutcome:
    result: dict[str, Any] | None
    reason: str | None = None
    timed_out: bool = False
    #: the child failed to start or died: says nothing about this question, so not cached
    transient: bool = False


def _prv_in_child(job: dict[str, Any], timeout_s: float) -> _ChildOutcome:
    """Run the PRV calibration in a spawned child so it can be killed at the time bound.

    "spawn" rather than fork: the caller may be a Ray worker or have torch threads running,
    and forking a multithreaded process can deadlock. As with any spawn, the caller's main
    script is re-imported in the child, so scripts need an ``if __name__ == "__main__":``
    guard (console scripts, pytest and Ray workers have one).
    """
    ctx = multiprocessing.get_context("spawn")
    recv_end, send_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_prv_worker, args=(send_end, job), name="dpsweep-prv",
                       daemon=True)
    try:
        proc.start()
    except Exception as exc:
        recv_end.close()
        return _ChildOutcome(None, f"prv-accountant could not be started in a child process "
                                   f"({type(exc).__name__}: {exc}); RDP used", transient=True)
    finally:
        send_end.close()  # so a child that dies without answering reads as EOF here
    try:
        if not recv_end.poll(None if math.isinf(timeout_s) else timeout_s):
            return _ChildOutcome(None, f"prv-accountant did not finish within {timeout_s:g} s; "
                                       "RDP used", timed_out=True)
        try:
            msg = recv_end.recv()
        except EOFError:
            proc.join(5)
            return _ChildOutcome(None, f"prv-accountant's process exited (code "
                                       f"{proc.exitcode}) without an answer; RDP used",
                                 transient=True)
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        recv_end.close()
    if not msg.get("ok"):
        return _ChildOutcome(None, f"prv-accountant failed ({msg.get('error')}); RDP used")
    return _ChildOutcome(msg["result"])


# --------------------------------------------------------------------------------------------
# Cache


def default_cache_dir() -> Path:
    """$DPSWEEP_CACHE_DIR, else ~/.cache/dpsweep/budget: shared by all trials of a machine."""
    env = os.environ.get(_ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dpsweep" / "budget"


_MEMORY: dict[str, tuple[tuple[int, int, int] | None, dict[str, Any]]] = {}


def _key_hash(key: dict[str, Any]) -> str:
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _cache_get(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The entry at path, if it answers key; the in-process copy is used while the file is
    unchanged (so a file rewritten or corrupted by another process is re-read)."""
    sig = _signature(path)
    mem = _MEMORY.get(str(path))
    if mem is not None and mem[0] == sig:
        return mem[1]
    if sig is None:
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(entry, dict) and entry.get("schema") == SCHEMA_VERSION
                and entry.get("key") == key):
            raise ValueError("schema or key mismatch")
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable budget cache file %s (%s)", path, exc)
        return None
    _MEMORY[str(path)] = (sig, entry)
    return entry


def _cache_put(path: Path, entry: dict[str, Any]) -> None:
    """Atomic write (temp file + os.replace): concurrent trials never see half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(entry, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        logger.warning("could not write budget cache file %s (%s); keeping it in memory only",
                       path, exc)
        _MEMORY[str(path)] = (None, entry)
        return
    _MEMORY[str(path)] = (_signature(path), entry)


def _resolve_dir(cache_dir: str | Path | None) -> Path:
    return default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()


# --------------------------------------------------------------------------------------------
# Public entry points


def calibrate(*, target_epsilon: float, delta: float, sample_rate: float,
              steps: int | None = None, shape: Sequence[Phase] | None = None,
              cache_dir: str | Path | None = None, timeout_s: float = 120.0,
              use_cache: bool = True) -> Calibration:
    """The noise schedule scale * shape whose upper epsilon is in [0.99 T, T] for T = target.

    Give exactly one of steps (constant sigma) or shape (relative multipliers per phase).
    PRV calibrates, in a child process bounded by timeout_s; on timeout or failure the Opacus
    RDP calibration is returned with fallback_reason set. Results are cached on disk under
    cache_dir (default: default_cache_dir()); use_cache=False bypasses the cache entirely. A
    cached fallback caused by a timeout is retried when a longer timeout_s is given. The child
    is started with "spawn", so a calling script needs an ``if __name__ == "__main__":`` guard.
    """
    target = _check_epsilon(target_epsilon)
    d = _check_delta(delta)
    q = _check_sample_rate(sample_rate)
    if (steps is None) == (shape is None):
        raise UserInputError(field="steps", value={"steps": steps, "shape": shape},
                             allowed="exactly one of steps (constant noise) or shape "
                                     "(a schedule of relative noise multipliers)")
    if steps is not None:
        n = _check_int(steps, field="steps", low=1, allowed="an integer >= 1")
        phases: tuple[Phase, ...] = (Phase(noise_multiplier=1.0, steps=n),)
    else:
        phases = _check_schedule(shape)
    timeout = _check_timeout(timeout_s)

    eps_error = min(0.01, target * 0.002)
    key = {
        "schema": SCHEMA_VERSION,
        "kind": "calibration",
        "sample_rate": repr(q),
        "shape": [[repr(p.noise_multiplier), p.steps] for p in phases],
        "delta": repr(d),
        "target_epsilon": repr(target),
        "eps_error": repr(eps_error),
    }
    path = _resolve_dir(cache_dir) / f"calibration-{_key_hash(key)}.json"
    if use_cache:
        entry = _cache_get(path, key)
        if entry is not None:
            cal = _cached_calibration(entry, target=target, timeout=timeout)
            if cal is not None:
                return cal

    t0 = time.perf_counter()
    multipliers = [p.noise_multiplier for p in phases]
    counts = [p.steps for p in phases]
    try:
        u_rdp, eps_rdp, slope = _rdp_calibrate(multipliers=multipliers, steps=counts,
                                               sample_rate=q, delta=d, target=target)
    except _SearchError as exc:
        raise UserInputError(field="privacy.epsilon", value=target_epsilon,
                             allowed=f"a budget reachable with noise scales in "
                                     f"{list(_RDP_SCALE_RANGE)} ({exc})") from exc
    job = {"multipliers": multipliers, "steps": counts, "sample_rate": q, "delta": d,
           "target": target, "eps_error": eps_error,
           "eps_coarse": max(eps_error, min(0.1, 0.03 * target)), "u_rdp": u_rdp,
           "slope": slope}
    outcome = _prv_in_child(job, timeout)
    result, reason = outcome.result, outcome.reason
    if result is not None and not WINDOW * target <= result["upper"] <= target:
        reason = (f"prv-accountant's answer failed the final check (upper epsilon "
                  f"{result['upper']!r} outside [{WINDOW * target:.6g}, {target:g}]); RDP used")
        result = None
    if result is not None:
        logger.info("PRV calibration: %d coarse and %d fine evaluations",
                    result["coarse_evals"], result["fine_evals"])
        sigmas = result["sigmas"]
        scale = result["scale"]
        bounds = EpsilonBounds(lower=result["lower"], estimate=result["estimate"],
                               upper=result["upper"], accountant="prv")
        accountant, fallback = "prv", None
    else:
        logger.warning("budget calibration fell back to RDP: %s", reason)
        sigmas = _sigmas(u_rdp, multipliers)
        scale = math.exp(u_rdp)
        bounds = EpsilonBounds(lower=None, estimate=None, upper=eps_rdp, accountant="rdp")
        accountant, fallback = "rdp", reason
    cal = Calibration(
        target_epsilon=target, delta=d, sample_rate=q,
        schedule=tuple(Phase(noise_multiplier=s, steps=n)
                       for s, n in zip(sigmas, counts, strict=True)),
        scale=scale, bounds=bounds, accountant=accountant, fallback_reason=fallback,
        eps_error=eps_error, seconds=time.perf_counter() - t0, cached=False)
    logger.info("calibrated noise %.6g (scale) for epsilon %g, delta %g, q %g, %d steps: "
                "upper %.6f via %s in %.2f s", scale, target, d, q, cal.steps, bounds.upper,
                accountant, cal.seconds)
    if use_cache and not outcome.transient:
        _cache_put(path, {"schema": SCHEMA_VERSION, "key": key, "calibration": cal.to_dict(),
                          "prv_timeout_s": timeout if outcome.timed_out else None})
    return cal


def _cached_calibration(entry: dict[str, Any], *, target: float,
                        timeout: float) -> Calibration | None:
    """The cached answer, unless it is unusable or a timeout that more time could fix."""
    try:
        cal = Calibration.from_dict(entry["calibration"])
        failed_timeout = entry.get("prv_timeout_s")
    except (UserInputError, KeyError, TypeError) as exc:
        logger.warning("ignoring malformed budget cache entry (%s)", exc)
        return None
    if not cal.bounds.upper <= target:
        return None
    if failed_timeout is not None and timeout > float(failed_timeout):
        return None
    return dataclasses.replace(cal, cached=True)


def epsilon_curve(calibration: Calibration, *, at_steps: Sequence[int],
                  cache_dir: str | Path | None = None,
                  use_cache: bool = True) -> list[EpsilonBounds]:
    """Epsilon spent after k steps of the calibrated schedule, for each k in at_steps.

    Uses the calibration's accountant (and eps_error), so the point at the full step count
    reproduces calibration.bounds. The PRV accountant is built once, for the full schedule,
    and composed with truncated counts per k. Cached like calibrations (a sweep asks for the
    same curve in every trial).
    """
    if not isinstance(calibration, Calibration):
        raise UserInputError(field="calibration", value=type(calibration).__name__,
                             allowed="a Calibration returned by calibrate()")
    total = calibration.steps
    if isinstance(at_steps, (str, bytes)):
        raise UserInputError(field="at_steps", value=at_steps,
                             allowed=f"a sequence of integers in [1, {total}]")
    ks = [_check_int(k, field="at_steps", low=1, allowed=f"integers in [1, {total}]")
          for k in at_steps]
    for k in ks:
        if k > total:
            raise UserInputError(field="at_steps", value=k, allowed=f"integers in [1, {total}]")
    if not ks:
        return []

    key = {
        "schema": SCHEMA_VERSION,
        "kind": "curve",
        "accountant": calibration.accountant,
        "sample_rate": repr(calibration.sample_rate),
        "delta": repr(calibration.delta),
        "eps_error": repr(calibration.eps_error),
        "schedule": [[repr(p.noise_multiplier), p.steps] for p in calibration.schedule],
        "at_steps": ks,
    }
    path = _resolve_dir(cache_dir) / f"curve-{_key_hash(key)}.json"
    if use_cache:
        entry = _cache_get(path, key)
        if entry is not None:
            try:
                return [EpsilonBounds.from_dict(b) for b in entry["points"]]
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("ignoring malformed epsilon-curve cache entry (%s)", exc)

    unique = sorted(set(ks))
    points: dict[int, EpsilonBounds] = {}
    if calibration.accountant == "prv":
        try:
            points = _prv_curve(calibration, unique)
        except Exception as exc:
            logger.warning("PRV epsilon curve failed (%s: %s); using RDP for the curve",
                           type(exc).__name__, exc)
    if not points:
        points = _rdp_curve(calibration, unique)
    curve = [points[k] for k in ks]
    if use_cache:
        _cache_put(path, {"schema": SCHEMA_VERSION, "key": key,
                          "points": [b.to_dict() for b in curve]})
    return curve


def _prefix_counts(schedule: Sequence[Phase], k: int) -> list[int]:
    counts, start = [], 0
    for p in schedule:
        counts.append(min(p.steps, max(0, k - start)))
        start += p.steps
    return counts


def _prv_curve(cal: Calibration, ks: Sequence[int]) -> dict[int, EpsilonBounds]:
    import numpy as np
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=cal.sample_rate,
                                               noise_multiplier=p.noise_multiplier)
            for p in cal.schedule]
    out: dict[int, EpsilonBounds] = {}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        acc = PRVAccountant(prvs=prvs, max_self_compositions=[p.steps for p in cal.schedule],
                            eps_error=cal.eps_error,
                            delta_error=cal.delta * _DELTA_ERROR_FACTOR)
        for k in ks:
            lo, est, up = _checked_triple(*acc.compute_epsilon(
                delta=cal.delta, num_self_compositions=_prefix_counts(cal.schedule, k)))
            out[k] = EpsilonBounds(lower=lo, estimate=est, upper=up, accountant="prv")
    return out


def _rdp_curve(cal: Calibration, ks: Sequence[int]) -> dict[int, EpsilonBounds]:
    sigmas = [p.noise_multiplier for p in cal.schedule]
    return {k: EpsilonBounds(lower=None, estimate=None, accountant="rdp",
                             upper=_rdp_upper(sigmas=sigmas,
                                              steps=_prefix_counts(cal.schedule, k),
                                              sample_rate=cal.sample_rate, delta=cal.delta))
            for k in ks}
