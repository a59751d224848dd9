"""The calibration cache, verified: many trial processes ask the same question, and none trusts
the file it is answered from.

Answers are kept on disk (``core.storage.JsonCache``) and every hit is re-checked before use by
the independent accountants of ``orchestrator.accounting.verify``; an entry that fails any check
is never trained with: it is ignored (logged once, naming the file and the contradiction) and
the answer recomputed, as for any cache (:mod:`core.hints`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any

from dpsweep.core.errors import CacheIntegrityError, UserInputError
from dpsweep.core.hints import ignored
from dpsweep.core.schedule import Schedule
from dpsweep.core.storage import JsonCache, canonical_hash
from dpsweep.core.trial import SCHEMA_VERSION, Calibration
from dpsweep.orchestrator.accounting.certificate import WINDOW
from dpsweep.orchestrator.accounting.verify import verify_calibration

logger = logging.getLogger(__name__)

CACHE_NAMESPACE = "calibration"
"""Sub-directory of the cache directory that holds calibrations."""

_ENV_CACHE_DIR = "DPSWEEP_CACHE_DIR"


def default_cache_dir() -> Path:
    """$DPSWEEP_CACHE_DIR, else ~/.cache/dpsweep/budget: shared by all trials of a machine."""
    env = os.environ.get(_ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dpsweep" / "budget"


_VERIFIED: set[str] = set()
"""Canonical hashes of (key, entry) pairs verified in this process: identical bytes get the same
verdict, so they are not re-verified."""


def cache_for(cache_dir: str | Path | None) -> JsonCache:
    return JsonCache(default_cache_dir() if cache_dir is None else Path(cache_dir),
                     CACHE_NAMESPACE)


def calibration_key(*, sample_rate: float, shape: Schedule, delta: float, target_epsilon: float,
                    eps_error: float) -> dict[str, Any]:
    """The question a cache entry answers, floats as their exact reprs."""
    return {
        "schema": SCHEMA_VERSION,
        "kind": "calibration",
        "sample_rate": repr(sample_rate),
        "shape": [[repr(p.noise_multiplier), p.steps] for p in shape.phases],
        "delta": repr(delta),
        "target_epsilon": repr(target_epsilon),
        "eps_error": repr(eps_error),
    }


def lookup(cache: JsonCache, key: dict[str, Any], *, shape: Schedule,
           timeout: float) -> Calibration | None:
    """The verified cached answer to ``key``, None when there is none, when more time may now
    give a PRV answer, or when the entry fails any check: a cache is a hint, so a tampered or
    corrupted entry is never trained with but ignored (logged once, naming the file and why)
    and recomputed, and the fresh answer replaces it."""
    value = cache.get(key)
    if value is None:
        return None
    path = cache.path(key)
    try:
        return _cached_calibration(value, key=key, shape=shape, path=path, timeout=timeout)
    except CacheIntegrityError as exc:
        ignored(path, exc.allowed)
        return None


def store(cache: JsonCache, key: dict[str, Any], calibration: Calibration, *,
          prv_timeout_s: float | None) -> None:
    """Keep a fresh answer; ``prv_timeout_s`` is the time bound a PRV calibration ran out of (a
    later question with more time retries it). Its own bytes need no verification here."""
    value = {"calibration": calibration.to_dict(), "prv_timeout_s": prv_timeout_s}
    if cache.put(key, value) is None:
        logger.warning("could not write the budget cache under %s", cache.directory)
    else:
        _VERIFIED.add(canonical_hash({"key": key, "value": value}))


def _cached_calibration(value: Any, *, key: dict[str, Any], shape: Schedule, path: Path,
                        timeout: float) -> Calibration | None:
    """The verified cached answer, None if more time may now give a PRV answer; a cached
    answer that fails any check raises CacheIntegrityError naming the file."""
    def bad(why: str) -> CacheIntegrityError:
        return CacheIntegrityError(field="budget cache", value=str(path),
                                   allowed=f"a consistent calibration entry, but {why}; delete "
                                           "the file to recompute")

    try:
        cal = Calibration.from_dict(value["calibration"])
        failed_timeout = value.get("prv_timeout_s")
        failed_timeout = None if failed_timeout is None else float(failed_timeout)
    except (UserInputError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise bad(f"it does not parse ({exc})") from None
    if failed_timeout is not None and timeout > failed_timeout:
        return None
    expected = {"target_epsilon": float(key["target_epsilon"]), "delta": float(key["delta"]),
                "sample_rate": float(key["sample_rate"]), "eps_error": float(key["eps_error"])}
    for name, want in expected.items():
        if getattr(cal, name) != want:
            raise bad(f"its {name} {getattr(cal, name)!r} differs from the question's {want!r}")
    phases, wanted = cal.schedule.phases, shape.phases
    if len(phases) != len(wanted) or any(
            p.steps != w.steps or not math.isclose(p.noise_multiplier, cal.scale
                                                   * w.noise_multiplier, rel_tol=1e-12)
            for p, w in zip(phases, wanted, strict=False)):
        raise bad("its schedule is not scale x the requested shape")
    b = cal.bounds
    ordered = (b.lower is None) == (b.estimate is None) and (
        b.lower is None or (b.lower <= b.estimate <= b.upper))  # type: ignore[operator]
    if b.accountant != cal.accountant or not ordered or (cal.accountant == "prv"
                                                          and b.lower is None):
        raise bad("its bounds are malformed")
    if not WINDOW * cal.target_epsilon <= b.upper <= cal.target_epsilon:
        raise bad(f"its upper bound {b.upper!r} is outside [{WINDOW} T, T]")
    digest = canonical_hash({"key": key, "value": value})
    if digest not in _VERIFIED:
        check = verify_calibration(cal, source=str(path))
        logger.info("cached calibration verified: PLD %.6f (error %.3g) vs upper %.6f in %.2f s",
                    check.pld_epsilon, check.pld_error, b.upper, check.seconds)
        _VERIFIED.add(digest)
    return dataclasses.replace(cal, cached=True)
