"""The README's ``ray job submit`` line, run as written against a ``ray start --head`` cluster.

A head node with the dashboard (``ray[default]``) is started on this machine with token
authentication, in the environment a user gets by activating the project's venv (the job's
entrypoint runs with the PATH that ``ray start`` had, so that is where ``dpsweep`` must be
found). Two sweeps are submitted:

* ``--out`` absolute (the README's form), from a working directory holding a user's model
  module, an ``.npz`` and ``sweep.toml``: the job SUCCEEDS, the run directory holds the results
  of every trial, the job's driver registered with this cluster (``RAY_ADDRESS``, set inside a
  job, made ``dpsweep`` connect instead of starting a private Ray), every trial ran on this
  cluster's head node, and the module reached the workers through the job's working directory;
* ``--out`` relative, from a directory holding only ``sweep.toml``: it resolves against the job's
  copy of the working directory, unpacked under Ray's session directory on the head node, not
  against the directory it was submitted from.

Cleanup does not use ``ray stop``: it has no ``--temp-dir`` (Ray 2.60) and kills every Ray
process of the machine, other tests' and other users' included. The head is started in a
session of its own; every process of that session, and every descendant of one (the job's
driver runs in a new session under the job supervisor), is killed by pid, and the test asserts
that none is left and no process names its temp dir.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.cli_harness import processes

ray = pytest.importorskip("ray")


def _dashboard_missing() -> str | None:
    """Why the dashboard and the jobs CLI cannot run here (None: they can).

    ``ray.dashboard.optional_deps`` is Ray's own list of what the dashboard needs; the jobs
    CLI also needs ``requests``.
    """
    try:
        import ray.dashboard.optional_deps  # noqa: F401
        import requests  # noqa: F401
    except ImportError as exc:
        return (f"ray[default] is not installed ({exc}): the dashboard and `ray job submit` "
                "need it (`pip install -e .` installs it)")
    return None


_MISSING = _dashboard_missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 300  # one job, a 2-trial sweep of 1 epoch, took 25-30 s on 2 busy cores
GONE_S = 30.0
TRIALS = 2
SWEEP = f"""\
[training]
epochs = 1
batch_size = 50
[method_params]
lr = 1.0
clip_norm = 1.0
[sweep]
methods = ["dpsgd"]
trials_per_method = {TRIALS}
max_concurrent_trials = 2
baseline = false
[audit]
enabled = false
"""
# Queried in a separate process: the token and Ray's per-process auth config stay out of this one.
JOB_INFO = textwrap.dedent("""\
    import json, sys
    from ray.job_submission import JobSubmissionClient
    info = JobSubmissionClient(sys.argv[1]).get_job_info(sys.argv[2])
    print(json.dumps({"status": str(info.status.value), "job_id": info.job_id,
                      "driver": info.driver_info.pid if info.driver_info else None,
                      "message": info.message}))
""")


@dataclass
class Head:
    temp_dir: Path
    session: int  # the session ``ray start`` ran in: every Ray daemon it started is in it
    dashboard: str  # http://127.0.0.1:PORT
    env: dict[str, str]  # the activated venv, with the cluster's token


def _free_port() -> int:
    """A port free on every interface (Ray's GCS binds the wildcard address)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _owned(session: int) -> dict[int, str]:
    """pid -> name of every process in ``session`` and every descendant of one."""
    procs = processes()
    owned = {pid for pid, p in procs.items() if p.session == session}
    grew = True
    while grew:
        new = {pid for pid, p in procs.items() if p.parent in owned} - owned
        owned |= new
        grew = bool(new)
    return {pid: procs[pid].name for pid in owned
            if pid in procs and procs[pid].state != "Z" and pid != os.getpid()}


def _naming(temp_dir: Path) -> set[int]:
    """Live processes whose command line names ``temp_dir`` (gcs_server, raylet, agents...)."""
    found = set()
    needle = str(temp_dir).encode()
    for pid, p in processes().items():
        if p.state == "Z":
            continue
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:
            continue
    return found


def _kill_all(head: Head) -> None:
    """SIGKILL (as ``ray stop --force`` does) every process of this head, by pid, until none is
    left: killing a parent can leave a child that the next round sees."""
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline:
        pids = set(_owned(head.session)) | _naming(head.temp_dir)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


@pytest.fixture
def head(tmp_path: Path) -> Iterator[Head]:
    # Ray's Unix socket paths (temp dir + session + sockets/...) must fit in 107 bytes.
    temp_dir = Path(f"/tmp/rj{secrets.token_hex(4)}")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "VIRTUAL_ENV"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(BIN.parent),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    dashboard_port = _free_port()
    # Ray rewrites --node-ip-address=127.0.0.1 to the routable address (docs/security.md), so
    # its gRPC servers bind every interface; the dashboard stays on 127.0.0.1. The fixed default
    # ports (dashboard agent 52365, Ray Client 10001) are replaced so runs cannot collide.
    args = [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
            f"--port={_free_port()}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
            "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = Head(temp_dir=temp_dir, session=proc.pid,
                   dashboard=f"http://127.0.0.1:{dashboard_port}", env=env)
    try:
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, out[-4000:]
        assert "Ray runtime started" in out, out[-4000:]
        yield started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_all(started)
        left = _owned(started.session)
        named = _naming(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == {} and named == set(), f"Ray processes left: {left} {named}"


def _submit(head: Head, workdir: Path, out: str) -> subprocess.Popen[str]:
    """The README's line as written, with the dashboard's port and ``--out`` filled in, started
    (``_ended`` waits for it)."""
    args = [str(BIN / "ray"), "job", "submit", "--address", head.dashboard, "--working-dir",
            ".", "--", "dpsweep", "run", "sweep.toml", "--out", out]
    return subprocess.Popen(args, cwd=workdir, env=head.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _ended(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """A submission's exit status and output, once it ended (killed past JOB_TIMEOUT_S)."""
    try:
        log, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    return proc.returncode, log


def _submission_id(log: str) -> str:
    submitted = re.search(r"Job '([^']+)' submitted successfully", log)
    assert submitted, log[-6000:]
    return submitted.group(1)


def _job_info(head: Head, submission_id: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", JOB_INFO, head.dashboard, submission_id],
                          env=head.env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _head_node_id(head: Head) -> str:
    """The node id on our raylet's command line (``--node_id=...``)."""
    ids = []
    for pid, name in _owned(head.session).items():
        if name != "raylet":
            continue
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ids += [a.split(b"=", 1)[1].decode() for a in args if a.startswith(b"--node_id=")]
    assert len(ids) == 1, ids
    return ids[0]


def _check_run(run_dir: Path, node_id: str) -> None:
    from dpsweep.orchestrator import api

    frame = api.results(run_dir)  # verified against the run's manifest
    assert len(frame) == TRIALS, frame[["trial_id", "status"]]
    assert (frame["status"] == "ok").all(), frame[["trial_id", "error"]]
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("trials/*/result.json"))]
    assert len(records) == TRIALS
    # Every trial ran on the head node started above, not on a Ray the driver started itself.
    assert {r["node"] for r in records} == {node_id}


def test_ray_job_submit_runs_a_sweep_on_the_cluster(head: Head, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "sweep.toml").write_text(SWEEP)
    node_id = _head_node_id(head)
    gcs_before = {pid for pid, name in _owned(head.session).items() if name == "gcs_server"}
    assert len(gcs_before) == 1

    # Absolute --out, with a user's model and data in the working directory (the README's job
    # line as a user runs it): the run directory is where it says (shared storage on a real
    # cluster), and the module reaches the workers through the job's own working directory.
    import numpy as np
    from sklearn.datasets import load_digits

    user = tmp_path / "user"
    user.mkdir()
    (user / "job_net.py").write_text(
        "from torch import nn\n\ndef build(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(),\n"
        "                         nn.Linear(16, num_classes))\n")
    digits = load_digits()
    np.savez(user / "digits.npz", x=digits.data.astype(np.float32), y=digits.target)
    (user / "sweep.toml").write_text(SWEEP.replace(
        "[training]", "[data]\ndataset = 'file'\npath = 'digits.npz'\n"
                      "[model]\nfactory = 'job_net:build'\n[training]"))
    run_dir = tmp_path / "runs" / "user"
    # Both jobs are submitted at once (the sweeps' trials share the head's CPUs), each checked
    # once both ended.
    user_job = _submit(head, user, str(run_dir))
    relative_job = _submit(head, workdir, "runs/job1")
    (code, log), relative = _ended(user_job), _ended(relative_job)
    job = _submission_id(log)
    assert code == 0, log[-6000:]
    info = _job_info(head, job)
    assert info["status"] == "SUCCEEDED", info
    # The entrypoint's driver registered with this cluster (a driver that started its own Ray
    # would not have): RAY_ADDRESS inside the job led dpsweep to connect.
    assert info["job_id"] and info["driver"], info
    assert "sweep finished: 2 trials (0 failed)" in log, log[-6000:]
    _check_run(run_dir, node_id)

    # Relative --out: resolved against the job's copy of the working directory, which Ray
    # unpacks under its session directory on the head node, not the directory submitted from.
    code, log = relative
    job = _submission_id(log)
    assert code == 0, log[-6000:]
    assert _job_info(head, job)["status"] == "SUCCEEDED"
    assert not (workdir / "runs").exists()
    found = list(head.temp_dir.glob(
        "session_latest/runtime_resources/working_dir_files/_ray_pkg_*/runs/job1"))
    assert len(found) == 1, found
    _check_run(found[0], node_id)

    # Still the one GCS this test started: no job started a cluster of its own and left it.
    gcs_after = {pid for pid, name in _owned(head.session).items() if name == "gcs_server"}
    assert gcs_after == gcs_before
