"""The contract tier's rule, enforced (``tests/tiers.py``): a contract test runs no sweep and
starts no Ray; sweeps are for ``tests/system``."""

from __future__ import annotations

from tests.tiers import switch, tier_hooks


def _install() -> None:
    switch("dpsweep.orchestrator.sweep.driver", "_drive", refused_in=frozenset({"contract"}),
           what="ran a sweep (orchestrator.sweep.driver._drive)")


pytest_runtest_setup, pytest_runtest_call = tier_hooks("contract", _install)
