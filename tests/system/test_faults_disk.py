"""A full disk, on the real CLI: the run directory on a small tmpfs filled at three writes.

One chain of commands on one run directory (issue 26, item 2):

a. ``run``; the file system fills as a trial writes its record (``result.json``, in the worker:
   the line names the first write the full disk refused, that one or a concurrent one);
b. space freed; ``resume``; it fills as the driver writes the results store;
c. space freed; ``resume``; it fills as the driver writes the Optuna storage (SQLite);
d. space freed; ``resume`` to the end.

Each filled stage must stop with exit code ``EXIT_DISK_FULL`` and one line on stderr naming the
file that could not be written, the full disk and the resume (no traceback; the line itself is
``orchestrator.cli``'s); the end has the ids of an uninterrupted sweep, no Optuna trial RUNNING,
no failed row, no finished trial trained twice, and the trial the disk stopped recorded with that
reason and finished later under its id.

The moment is exact: a ``sitecustomize`` on the commands' PYTHONPATH (driver and Ray workers)
fills the file system right before the chosen write, once. Mounting a tmpfs needs root (or
CAP_SYS_ADMIN); elsewhere the module is skipped with the reason.

Nothing here depends on when a command runs, so the chain is a job of ``conftest.py``'s lane:
it runs while ``test_faults.py``'s chain does when both modules are in the session (the tests
here then find it done), else when this module's first test asks for it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.cli_harness import complete_ids, result_ids, running
from dpsweep.core.errors import EXIT_DISK_FULL
from tests.system.conftest import Lane
from tests.system.test_faults import Stage, run_stage

CONFIG = """\
[training]
epochs = 1
[sweep]
methods = ["dpsgd"]
trials_per_method = 4
max_concurrent_trials = 2
baseline = false
seeds = 0
[audit]
enabled = false
"""
IDS = sorted(f"dpsgd_eps3-{i:03d}" for i in range(4))
#: Room for a whole run directory (records, checkpoints, Tune's files, report).
TMPFS_SIZE = "64m"

#: Loaded by every Python process of a command (the driver and Ray's workers): wraps one write
#: so that the file system is full when it happens (see the module docstring).
SITECUSTOMIZE = '''
import importlib.abc
import os
import sys

WHERE = os.environ.get("DPSWEEP_TEST_FILL", "")
MARK = os.environ.get("DPSWEEP_TEST_FILL_MARK", "")
FILLER = os.environ.get("DPSWEEP_TEST_FILLER", "")
TARGETS = {"trial-record": "result.json", "results": "results.parquet"}


def fill():
    """Take every free byte of the file system holding FILLER, once (MARK says it happened)."""
    try:
        os.close(os.open(MARK, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    fd = os.open(FILLER, os.O_CREAT | os.O_WRONLY | os.O_APPEND)
    try:
        for size in (1 << 20, 1 << 16, 4096, 1):
            while True:
                try:
                    os.write(fd, bytes(size))
                except OSError:
                    break
    finally:
        os.close(fd)


def patch_storage(module):
    original = module.atomic_write

    def atomic_write(path, write):
        if os.path.basename(str(path)) == TARGETS.get(WHERE):
            fill()
        return original(path, write)

    module.atomic_write = atomic_write


def patch_studies(module):
    import optuna

    original = optuna.study.Study.tell

    def tell(self, *args, **kwargs):
        if WHERE == "optuna":
            fill()
        return original(self, *args, **kwargs)

    optuna.study.Study.tell = tell


class After(importlib.abc.MetaPathFinder):
    """Runs a patch on a module right after it is executed."""

    PATCHES = {"dpsweep.core.storage": patch_storage,
               "dpsweep.orchestrator.sweep.studies": patch_studies}

    def find_spec(self, name, path, target=None):
        patch = self.PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if WHERE and MARK and FILLER:
    sys.meta_path.insert(0, After())
'''


@dataclass
class Chain:
    run: Path  # on the tmpfs, unmounted once the chain ended: the path the lines name
    files: Path  # the run directory, copied off the tmpfs after the last command
    stages: dict[str, Stage]
    marks: dict[str, bool]
    lines: list[str]  # a line per command, printed by the fixture


def _mount(where: Path) -> None:
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs",
                               str(where)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs to fill ({exc})")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill: {done.stderr.strip() or done.returncode}")


def _unmount(where: Path) -> None:
    for args in (["umount", str(where)], ["umount", "-l", str(where)]):
        if subprocess.run(args, capture_output=True, timeout=30).returncode == 0:
            return


def run_chain(tmp: Path, env: dict[str, str]) -> Chain:
    """The four commands on a tmpfs mounted under ``tmp``, each with ``env`` (this process's
    environment when the job was made) and its own fill settings: nothing here reads or changes
    this process's environment, so that the chain can run in ``conftest.py``'s lane while other
    tests run. The run directory is copied off the tmpfs, which is unmounted, before it returns."""
    disk = tmp / "disk"
    hooks = tmp / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp / "logs").mkdir()
    config = tmp / "sweep.toml"
    config.write_text(CONFIG)
    run, filler = disk / "run", disk / "filler"
    stages: dict[str, Stage] = {}
    marks: dict[str, bool] = {}
    lines: list[str] = []
    hooked = {**env, "PYTHONPATH": os.pathsep.join(
                  [str(hooks), *filter(None, [env.get("PYTHONPATH")])]),
              "DPSWEEP_TEST_FILLER": str(filler)}
    _mount(disk)
    try:
        for name, where, args in (
                ("a", "trial-record", ["run", str(config), "--out", str(run)]),
                ("b", "results", ["resume", str(run)]),
                ("c", "optuna", ["resume", str(run)]),
                ("d", "", ["resume", str(run)])):
            mark = tmp / f"filled-{name}"
            stages[name] = run_stage(name, [*args, "--quiet"], run=run, fault="", ready=None,
                                     logs=tmp / "logs",
                                     env={**hooked, "DPSWEEP_TEST_FILL": where,
                                          "DPSWEEP_TEST_FILL_MARK": str(mark)})
            marks[name] = mark.exists()
            filler.unlink(missing_ok=True)  # the space is freed
            lines.append(f"{name}: rc {stages[name].rc}, {stages[name].seconds:.0f} s, "
                         f"stderr {stages[name].stderr.strip()[-300:]!r}")
    finally:
        with contextlib.suppress(OSError):
            shutil.copytree(run, tmp / "run-copy")  # read by the tests; a look after a failure
        _unmount(disk)
    return Chain(run=run, files=tmp / "run-copy", stages=stages, marks=marks, lines=lines)


def lane_job(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Chain]:
    """The chain as a job for ``conftest.py``'s lane, its folder and environment taken now."""
    return functools.partial(run_chain, tmp_path_factory.mktemp("disk"), dict(os.environ))


@pytest.fixture(scope="module")
def chain(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> Chain:
    done: Chain = lane.result(__name__, lambda: lane_job(tmp_path_factory))
    for line in done.lines:
        print(line)
    return done


@pytest.mark.parametrize(("name", "what"), [("a", "/"), ("b", "/results.parquet"),
                                            ("c", "/optuna.db")])
def test_a_full_disk_stops_the_sweep_with_one_line_naming_what_was_not_written(
        chain: Chain, name: str, what: str) -> None:
    stage = chain.stages[name]
    assert chain.marks[name], f"{name}: the disk was never filled:\n{stage.stderr[-3000:]}"
    assert stage.rc == EXIT_DISK_FULL, (stage.rc, stage.stderr[-3000:])
    assert "Traceback" not in stage.stderr, stage.stderr[-3000:]
    lines = stage.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    line, run = lines[0], chain.run.resolve()
    assert line.startswith("dpsweep: ") and "the disk is full" in line, line
    # Stage a fills the disk before a trial's record, but whichever write comes first in the run
    # directory meets the full disk (the Optuna storage may): the line names a file there.
    named = (f"could not write {run}{what}" in line
             or f"could not write the Optuna storage {run}{what}" in line)
    assert named or (name == "a" and f" {run}/" in line), line
    assert f"`dpsweep resume {run}`" in line, line


def test_after_space_is_freed_resume_finishes_the_sweep_of_an_uninterrupted_run(
        chain: Chain) -> None:
    end = chain.stages["d"]
    assert end.rc == 0, end.stderr[-3000:]
    assert sorted(end.ids) == IDS  # every trial once, none failed or lost
    assert complete_ids(end.trials) == IDS and running(end.trials) == []
    for stage in chain.stages.values():
        assert stage.redone() == [], (stage.name, stage.redone())  # nothing trained twice
    from dpsweep.reports.store import read_results

    frame = read_results(chain.files)
    assert set(frame["status"]) == {"ok"}, frame[["trial_id", "status", "error"]]
    assert result_ids(chain.files) == list(frame["trial_id"])


def test_the_trial_the_disk_stopped_records_why_and_runs_again_under_its_id(
        chain: Chain) -> None:
    trials = chain.stages["d"].trials
    stopped = [t for t in trials if t["state"] == "FAIL"
               and "the disk is full" in str(t["attrs"].get("error", ""))]
    assert stopped, [(t["id"], t["state"], t["attrs"].get("error")) for t in trials]
    for t in stopped:
        assert t["attrs"].get("interrupted") is True, t
        assert t["id"] in complete_ids(trials), t
