"""What each test tier may do, enforced (docs/design.md, "Test tiers").

* unit (``tests/unit``): no process and no Ray. Starting a process (``subprocess``, ``os.fork``,
  ``os.posix_spawn``, ``os.system``, ``os.exec*``; Ray's own start is one of these) or calling
  ``ray.init`` while a unit test is set up or runs raises :class:`TierError`.
* contract (``tests/contract``): processes (the installed script, fresh interpreters) but no
  sweep and no Ray: the sweep driver's ``_drive`` and ``ray.init`` raise :class:`TierError`.
* system (``tests/system``): anything.

A violation also fails the test where the code under test caught the error (a fallback on any
exception). Teardown is not guarded: fixtures of other tiers may end their processes there.

The guards are switches installed once per session around the real functions (an audit hook,
which cannot be removed, and wrappers that call through outside their tier), so a test's own
``monkeypatch`` of the same names restores them as it found them.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

#: Audit events (``sys.addaudithook``) of everything that starts a process.
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn",
                            "os.spawn", "os.system", "os.exec", "pty.spawn"})
WHERE = {"unit": "tests/contract (a fresh interpreter, the installed script) or tests/system "
                 "(Ray, a sweep)",
         "contract": "tests/system"}


class TierError(RuntimeError):
    """A test did what its tier may not do."""


class State:
    """The tier of the test being set up or run (None outside one, and during teardown), and
    the first violation of that test."""

    tier: str | None = None
    violation: str | None = None
    hooked = False


def refuse(what: str) -> None:
    tier = State.tier
    message = (f"a {tier} test {what}: {tier} tests may not; move it to {WHERE[tier or 'unit']}"
               " (docs/design.md, Test tiers)")
    State.violation = State.violation or message
    raise TierError(message)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if State.tier == "unit" and event in PROCESS_EVENTS:
        what = args[1] if event == "subprocess.Popen" and len(args) > 1 else args[:1]
        refuse(f"started a process ({event} {what!r})")


def switch(module: str, name: str, *, refused_in: frozenset[str], what: str,
           instead: Callable[..., Any] | None = None) -> None:
    """Wrap ``module.name`` once: in a tier of ``refused_in`` it raises (or, with ``instead``,
    calls that in unit tests); elsewhere it calls through to the real function."""
    mod = sys.modules.get(module) or importlib.import_module(module)
    real = getattr(mod, name)
    if getattr(real, "__tier_switch__", False):
        return

    @functools.wraps(real)
    def switched(*args: Any, **kwargs: Any) -> Any:
        if State.tier in refused_in:
            if instead is not None and State.tier == "unit":
                return instead(*args, **kwargs)
            refuse(what)
        return real(*args, **kwargs)

    switched.__tier_switch__ = True  # type: ignore[attr-defined]
    setattr(mod, name, switched)


def guarded(tier: str, install: Callable[[], None]) -> Iterator[None]:
    """One phase (setup or call) of a test of ``tier`` under its guards; the body of a
    ``hookwrapper`` (it yields once, and receives pluggy's result)."""
    if not State.hooked:
        sys.addaudithook(_audit)
        State.hooked = True
    install()
    if "ray" in sys.modules:  # a Ray imported later is caught by its processes' start
        switch("ray", "init", refused_in=frozenset({"unit", "contract"}), what="called ray.init")
    State.tier, State.violation = tier, None
    try:
        outcome = yield
        if State.violation is not None and outcome.exception is None:
            outcome.force_exception(TierError(State.violation))
    finally:
        State.tier = None


def tier_hooks(tier: str, install: Callable[[], None]) -> tuple[Any, Any]:
    """``pytest_runtest_setup`` and ``pytest_runtest_call`` wrappers for a tier's conftest."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
        yield from guarded(tier, install)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
        yield from guarded(tier, install)

    return pytest_runtest_setup, pytest_runtest_call
