"""Issue 35, deliverable 3: every exit is one line with the right code.

Read-only run directories (``resume``'s lock, ``report``'s RUN_DIR/report): tests run as root,
which permission bits do not stop, so the ``OSError`` a read-only mount raises is forced where
the file is written. A second SIGINT while a stop is under way is ignored (tested on the handler
in-process; the real double Ctrl-C on a sweep is tests/system's). Ray start timeouts: retried
once with a longer wait, then one line, and a first ``run`` leaves no run directory. Ray's native
warnings before dpsweep's one line go to the log.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator import cli
from dpsweep.orchestrator.cluster import connection as cluster
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.sweep import commands, ray_start
from dpsweep.orchestrator.sweep.signals import EXIT_SIGINT, Interrupted, _StopFlag

TIMEOUT = Exception("The current node timed out during startup. This could happen because "
                    "some of the raylet failed to startup or the GCS has become overloaded.")


def _run_dir(tmp_path: Path) -> Path:
    run = RunDir.create(tmp_path / "run", config_text="# config\n")
    run.release()
    return run.path


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EPERM])
def test_resume_of_a_read_only_run_directory_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        code: int) -> None:
    path = _run_dir(tmp_path)

    def read_only(self: RunDir) -> None:
        raise OSError(code, os.strerror(code), str(self.path / ".lock"))

    monkeypatch.setattr(RunDir, "_acquire", read_only)
    assert cli.main(["resume", str(path)]) == cli.EXIT_USAGE
    line = _one_line(capsys)
    assert line.startswith("dpsweep: error: RUN_DIR = ") and str(path) in line
    assert "not writable" in line and ".lock" in line and os.strerror(code) in line


def test_report_on_a_read_only_run_directory_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import dpsweep.orchestrator.api
    path = _run_dir(tmp_path)

    def read_only(run_dir: Any) -> Path:
        raise OSError(errno.EROFS, "Read-only file system", str(Path(run_dir) / ".report.tmp"))

    monkeypatch.setattr(dpsweep.orchestrator.api, "report", read_only)
    assert cli.main(["report", str(path)]) == cli.EXIT_USAGE
    line = _one_line(capsys)
    assert "RUN_DIR = " in line and str(path) in line and "not writable" in line
    assert "report" in line and "Read-only file system" in line


def test_other_os_errors_are_not_taken_for_a_read_only_directory() -> None:
    import argparse

    args = argparse.Namespace(command="report", run_dir="r")
    assert cli.not_writable_line(args, OSError(errno.EIO, "I/O error")) is None
    assert cli.not_writable_line(args, ValueError("x")) is None


def test_a_write_outside_the_run_directory_names_its_own_flag(tmp_path: Path) -> None:
    import argparse

    args = argparse.Namespace(command="pick", run_dir=str(tmp_path / "run"),
                              export=str(tmp_path / "rel"))
    exc = OSError(errno.EACCES, "Permission denied", str(tmp_path / "rel" / "model.pt"))
    line = cli.not_writable_line(args, exc)
    assert line is not None and "--export = " in line


# ---- a second SIGINT while the first one stops the sweep ----------------------------
def test_a_second_signal_during_the_stop_is_ignored_not_raised_inside_ray() -> None:
    inside = _StopFlag()
    inside.in_tune = True
    inside.handler(signal.SIGINT, None)
    inside.handler(signal.SIGINT, None)  # 0.3 s later: would have raised inside CoreWorker.wait
    assert inside.event.is_set() and inside.repeats == 1
    outside = _StopFlag()
    with pytest.raises(Interrupted) as exc:
        outside.handler(signal.SIGINT, None)
    assert exc.value.exit_code == EXIT_SIGINT
    outside.handler(signal.SIGINT, None)  # during cluster.shutdown(): no second exception
    assert outside.repeats == 1


def test_the_cli_ignores_signals_once_it_reports_the_interrupt(
        capsys: pytest.CaptureFixture[str]) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def interrupted() -> None:
        raise Interrupted(signal.SIGINT, Path("/runs/x"))

    try:
        assert commands.sweep(interrupted) == EXIT_SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert "dpsweep resume /runs/x" in _one_line(capsys)


# ---- Ray start timeouts -----------------------------------------------------------------
def test_a_ray_start_timeout_is_retried_once_with_a_longer_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import services

    original = services.get_node
    calls: list[Any] = []

    def start_local(**kwargs: Any) -> str:
        calls.append(services.get_node)
        if len(calls) == 1:
            raise TIMEOUT
        return "info"

    monkeypatch.setattr(cluster, "start_local", start_local)
    assert ray_start.start_ray(address=None, quiet=True, runtime_env=None, pause_s=0) == "info"
    assert calls[0] is original and calls[1] is not original  # the retry waits longer
    assert services.get_node is original


def test_a_ray_that_times_out_twice_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def start_local(**kwargs: Any) -> str:
        raise TIMEOUT

    monkeypatch.setattr(cluster, "start_local", start_local)
    with pytest.raises(ray_start.RayStartFailed) as exc:
        ray_start.start_ray(address=None, quiet=True, runtime_env=None, pause_s=0)
    assert isinstance(exc.value, UserInputError) and "\n" not in str(exc.value)
    assert "timed out during startup twice" in str(exc.value)


def test_other_ray_start_failures_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def start_local(**kwargs: Any) -> str:
        calls.append(1)
        raise RuntimeError("something else")

    monkeypatch.setattr(cluster, "start_local", start_local)
    with pytest.raises(RuntimeError, match="something else"):
        ray_start.start_ray(address=None, quiet=True, runtime_env=None, pause_s=0)
    assert calls == [1]


def test_a_patient_get_node_keeps_asking_until_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import services

    answers = iter([RuntimeError("not yet"), RuntimeError("not yet"), "node"])

    def get_node(*args: Any) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(services, "get_node", get_node)
    monkeypatch.setattr(ray_start.time, "sleep", lambda s: None)
    with ray_start._patient_get_node(60.0):
        assert services.get_node("gcs", "id") == "node"


@pytest.mark.parametrize("existed", [False, True])
def test_a_first_run_whose_ray_did_not_start_leaves_no_run_directory(
        tmp_path: Path, existed: bool) -> None:
    out = tmp_path / "a" / "b" / "run"
    if existed:
        out.mkdir(parents=True)
    with pytest.raises(ray_start.RayStartFailed), ray_start.discarded_if_ray_fails(out):
        RunDir.create(out, config_text="# config\n").release()
        raise ray_start.RayStartFailed(field="local Ray", value="x", allowed="y")
    if existed:
        assert out.is_dir() and list(out.iterdir()) == []
    else:
        assert not (tmp_path / "a").exists()


def test_a_run_directory_stays_when_the_sweep_fails_otherwise(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(RuntimeError), ray_start.discarded_if_ray_fails(out):
        RunDir.create(out, config_text="# config\n").release()
        raise RuntimeError("a later failure: the run is resumable")
    assert (out / "manifest.json").is_file()


# ---- Ray's own warnings kept off the terminal -----------------------------------------
def test_native_warnings_before_a_refusal_go_to_the_log(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=ray_start.__name__), \
            pytest.raises(UserInputError), ray_start.native_stderr():
        os.write(2, b"[core_worker] InvalidAuthToken: token mismatch\n")
        raise UserInputError(field="--address", value="127.0.0.1:6379", allowed="a token")
    assert "InvalidAuthToken" not in capfd.readouterr().err
    assert "InvalidAuthToken" in caplog.text


def test_native_output_of_a_step_that_succeeds_is_kept(capfd: pytest.CaptureFixture[str]) -> None:
    with ray_start.native_stderr():
        os.write(2, b"a note from Ray\n")
    assert "a note from Ray" in capfd.readouterr().err


def test_tunes_failed_to_fetch_metrics_warning_is_off_the_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def start_local(**kwargs: Any) -> str:
        return "info"

    monkeypatch.setattr(cluster, "start_local", start_local)
    ray_start.start_ray(address=None, quiet=True, runtime_env=None)
    for name in ray_start.QUIET_RAY_LOGGERS:
        assert not logging.getLogger(name).isEnabledFor(logging.WARNING)
