"""Shared fixtures: an isolated budget cache per test session, one BLAS thread in this process,
tiny digits trials."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from dpsweep.orchestrator.config import Config, TrainingConfig
from tests.system.conftest import ONE_PROCESS


@pytest.fixture(scope="session", autouse=True)
def _budget_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Keep the accountant's cache inside the session so tests never read a stale user cache."""
    path = tmp_path_factory.mktemp("budget-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("DPSWEEP_CACHE_DIR", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def _one_blas_thread() -> Iterator[None]:
    """One OpenBLAS thread for the BLAS calls of this process (numpy's and scipy's builds).

    On a 2-core host that is busy (the suite's own sweeps, a second test run) the second BLAS
    thread spins waiting for a core: the audit's layer probes (scikit-learn's L-BFGS) took 24 s
    with two and 4.4 s with one. The pools' threads stay alive, merely idle, so the process
    has as many threads as before (``orchestrator.accounting.sandbox`` picks how to start its
    children by that count). Nothing else changes: processes the tests start keep their
    defaults (Ray's workers get one BLAS thread from Ray, through OMP_NUM_THREADS)."""
    import numpy  # noqa: F401  (loads numpy's OpenBLAS)
    import scipy.linalg  # noqa: F401  (loads scipy's own OpenBLAS)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


#: The group of the modules that share the fault chain's session state, as test file paths.
CHAIN_GROUP = "fault-chain"
CHAIN_FILES = frozenset(name.replace(".", "/") + ".py" for name in ONE_PROCESS)
SYSTEM_PREFIX = "tests/system/"


def work_unit(nodeid: str) -> str:
    """The work unit a test belongs to under ``make test``'s two xdist workers: its file, or
    the fault chain's group."""
    path = nodeid.split("::")[0]
    return CHAIN_GROUP if path in CHAIN_FILES else path


def _group_rank(nodeid: str) -> int:
    """0: the fault chain's modules, 1: other system modules, 2: unit and contract."""
    group = work_unit(nodeid)
    return 0 if group == CHAIN_GROUP else 1 if group.startswith(SYSTEM_PREFIX) else 2


class ModuleGroups(LoadScopeScheduling):
    """xdist's scope scheduling over :func:`work_unit` (``--dist loadgroup`` here).

    The reference sweep and the lane are session fixtures (``tests/system/conftest.py``): the
    chain's modules must run in one process, as in a single-process run, or each worker would
    start its own. Every other module is a unit of its own, so its module-scoped fixtures (a
    trained net, a smoke run, a local Ray) are built once. (xdist's own ``loadgroup`` reads
    ``xdist_group`` marks into node ids, which pytest 9 no longer lets it rewrite.)"""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    return ModuleGroups(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker under ``--dist loadgroup``: the longest groups first (the fault chain,
    then the other system modules), so that neither worker sits idle at the end while the
    other runs them; ``make test`` keeps that order (``--no-loadscope-reorder``)."""
    if getattr(config.option, "loadgroup", False):  # xdist's worker sets it (dist: "no")
        items.sort(key=lambda item: _group_rank(item.nodeid))  # stable within a rank


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_worker(request: pytest.FixtureRequest) -> Iterator[None]:
    """One intra-op torch thread in each xdist worker: two workers on two cores each running
    two threads would make every kernel wait for a core (see :func:`one_thread`)."""
    if getattr(request.config, "workerinput", None) is None:  # one process: as before
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: Signals whose disposition a test may change in this process (the CLI ignores them once it has
#: reported an interrupt); a child process inherits an ignored SIGINT and would never stop on
#: Ctrl-C, so every later test that interrupts a subprocess would hang.
RESTORED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _signals_restored() -> Iterator[None]:
    """Each test leaves SIGINT and SIGTERM as it found them."""
    before = {s: signal.getsignal(s) for s in RESTORED_SIGNALS}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)


def tiny_config(**training: object) -> Config:
    """Digits, 2 epochs of 10 Poisson steps (500 members, batch 50): a trial in about a second.

    ``lr`` and ``clip_norm`` go to ``[method_params]``; everything else to ``[training]``.
    """
    params = {k: training.pop(k) for k in ("lr", "clip_norm") if k in training}
    base: dict[str, object] = {"epochs": 2, "batch_size": 50}
    base.update(training)
    return dataclasses.replace(Config(), training=TrainingConfig(**base),
                               method_params={"lr": 1.0, "clip_norm": 1.0, **params})


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny tensors: a second thread only adds
    synchronisation, which on a busy 2-core host made each kernel several times slower (a
    conformance file ran 6x longer). Restored afterwards; a module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_local():
    """A loopback-only local Ray with 2 CPUs, shut down after the module."""
    from dpsweep.orchestrator.cluster import connection as cluster

    cluster.start_local(num_cpus=2, num_gpus=None, quiet=True)
    yield
    cluster.shutdown()


def leaves(value: object, path: str = "") -> list[tuple[str, object]]:
    """Every (dotted path, value) at the leaves of nested dicts and lists: what a test reads
    when it must see every value a file holds."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in leaves(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [x for v in value for x in leaves(v, path)]
    return [(path, value)]
