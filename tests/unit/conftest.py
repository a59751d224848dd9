"""The unit tier's rule, enforced (``tests/tiers.py``): a unit test starts no process and no Ray.

The PRV accountant's calibration, which the code under test runs in a child process
(``orchestrator.accounting.sandbox``) to bound its time, runs in this process in unit tests,
through the child's own ``_run_job`` and its JSON message: the answer is the child's; the
child itself (time bound, reuse, interrupts) is tested in
``tests/contract/test_accountant_sandbox.py``.
"""

from __future__ import annotations

import json
from typing import Any

from tests.tiers import switch, tier_hooks


def _prv_in_this_process(job: dict[str, Any], timeout_s: float) -> Any:
    """``sandbox.prv_in_child`` without the child (``timeout_s`` unenforced)."""
    from dpsweep.orchestrator.accounting import sandbox

    return sandbox._outcome(json.loads(json.dumps(sandbox._run_job(job))))


def _install() -> None:
    switch("dpsweep.orchestrator.accounting.calibration", "prv_in_child",
           refused_in=frozenset({"unit"}),
           what="ran the PRV accountant in a child", instead=_prv_in_this_process)


pytest_runtest_setup, pytest_runtest_call = tier_hooks("unit", _install)
