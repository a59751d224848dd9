"""Where a sweep runs: a loopback-only local Ray, fast honest connection errors, resource checks.

Sockets are read from /proc (``/proc/net/{tcp,tcp6,udp,udp6}`` plus each process's fd table), so
the check sees every listening socket of the driver's process tree, Ray's own processes
included, without a dependency.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.cli_harness import processes
from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator import raytemp
from dpsweep.orchestrator.cluster import connection as cluster
from dpsweep.orchestrator.cluster import resources, storage

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
FAST_S = 5.0  # refusals must come this quickly (Ray alone would hang or retry for minutes)
GONE_S = 20.0  # Ray's processes are gone this long after shutdown()
TCP_LISTEN = "0A"
UDP_UNCONNECTED = "07"
# Sockets allowed outside loopback, each with its reason. Ray 2.60 needs none once the node
# address stays 127.0.0.1 (measured: GCS, raylet x2, runtime-env agent, driver and workers).
ALLOWED_NON_LOOPBACK: dict[str, str] = {}


# --------------------------------------------------------------------------- /proc helpers


def _process_tree(root: int) -> dict[int, str]:
    """pid -> command name for root and all its descendants."""
    procs = processes()
    tree = {root}
    grew = True
    while grew:
        new = {pid for pid, p in procs.items() if p.parent in tree} - tree
        tree |= new
        grew = bool(new)
    return {pid: procs[pid].name if pid in procs else "?" for pid in tree}


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _decode(hex_addr: str) -> str:
    """An address as /proc/net writes it (host-order 32-bit words) in normal notation."""
    raw = bytes.fromhex(hex_addr)
    host = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(host))


def listening_sockets(root: int) -> list[tuple[str, int, str, str, int]]:
    """(proto, pid, process, local address, port) of every listening/bound socket in the tree."""
    owner: dict[str, tuple[int, str]] = {}
    for pid, name in _process_tree(root).items():
        for inode in _socket_inodes(pid):
            owner[inode] = (pid, name)
    found = []
    for proto, state in (("tcp", TCP_LISTEN), ("tcp6", TCP_LISTEN), ("udp", UDP_UNCONNECTED),
                         ("udp6", UDP_UNCONNECTED)):
        for line in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
            fields = line.split()
            local, st, inode = fields[1], fields[3], fields[9]
            if st != state or inode not in owner:
                continue
            addr, port = local.split(":")
            pid, name = owner[inode]
            found.append((proto, pid, name, _decode(addr), int(port, 16)))
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _wait_gone(pids: set[int]) -> set[int]:
    deadline = time.monotonic() + GONE_S
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {p for p in alive if _running(p)}
    return alive


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reaped-later child no longer holds sockets or memory)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def clean_ray():
    """No Ray before the test; whatever the test attached to is released after it."""
    assert not ray.is_initialized()
    yield
    cluster.shutdown()
    if ray.is_initialized():
        ray.shutdown()


# --------------------------------------------------------------------------- local Ray


def test_local_ray_listens_on_loopback_only_and_cleans_up(clean_ray: None,
                                                          capfd: pytest.CaptureFixture) -> None:
    saved = {k: os.environ.get(k) for k in (cluster.AUTH_MODE_ENV, cluster.AUTH_TOKEN_ENV)}
    info = cluster.start_local(num_cpus=1, num_gpus=None, quiet=True)
    assert info.local and info.token_auth
    assert [n.address for n in info.nodes] == [resources.LOOPBACK_V4]
    assert info.address.startswith(f"{resources.LOOPBACK_V4}:")
    # Logs, Unix sockets and spilled objects sit below a directory only this user can enter.
    private = Path(info.session_dir).parents[1]
    assert private.name.startswith(raytemp.PRIVATE_TEMP_PREFIX)
    assert private.stat().st_uid == os.getuid() and private.stat().st_mode & 0o077 == 0
    # A task makes Ray start a worker, whose own gRPC server must also be on loopback.
    assert ray.get(ray.remote(lambda: os.environ.get(cluster.AUTH_MODE_ENV)).remote()) == "token"

    sockets = listening_sockets(os.getpid())
    names = {name for _, _, name, _, _ in sockets}
    assert {"gcs_server", "raylet"} <= names, sockets  # the scan does see Ray's servers
    exposed = [s for s in sockets
               if not _is_loopback(s[3]) and s[2] not in ALLOWED_NON_LOOPBACK]
    assert exposed == [], f"sockets outside loopback: {exposed}"

    token = os.environ[cluster.AUTH_TOKEN_ENV]
    tree = _process_tree(os.getpid())
    for pid in tree:  # the per-run token travels in the environment, never on a command line
        try:
            assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
    assert not (Path.home() / ".ray" / "auth_token").is_file() or \
        (Path.home() / ".ray" / "auth_token").read_text().strip() != token

    cluster.shutdown()
    cluster.shutdown()  # idempotent
    assert not ray.is_initialized()
    assert _wait_gone(set(tree) - {os.getpid()}) == set()
    leaked = [f for f in Path(info.session_dir).rglob("*")
              if f.is_file() and not f.is_symlink() and token.encode() in f.read_bytes()]
    assert leaked == []  # not in Ray's logs either
    shutil.rmtree(info.session_dir, ignore_errors=True)
    assert {k: os.environ.get(k) for k in saved} == saved
    assert "Token authentication is enabled" not in capfd.readouterr().err


def test_start_local_refuses_bad_arguments_without_starting_ray(clean_ray: None) -> None:
    for kwargs, field in (({"num_cpus": 0, "num_gpus": None}, "num_cpus"),
                          ({"num_cpus": 1, "num_gpus": -1.0}, "num_gpus")):
        with pytest.raises(UserInputError) as err:
            cluster.start_local(**kwargs, quiet=True)
        assert err.value.field == field
    assert not ray.is_initialized()


# --------------------------------------------------------------------------- resources


def test_resources_beyond_this_machine_are_refused_before_ray_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever the machine has
    machine = resources.machine_resources()
    assert machine.cpus >= 1 and machine.gpus == 0 and machine.memory_mb > 0
    start = time.monotonic()
    with pytest.raises(UserInputError) as err:
        resources.check_resources(cpus_per_trial=64 + int(machine.cpus), gpus_per_trial=0.0,
                                memory_per_trial_mb=None, max_concurrent=2, info=None)
    assert err.value.field == "resources.cpus_per_trial"
    assert f"at most {machine.cpus:g}" in str(err.value)
    with pytest.raises(UserInputError) as err:
        resources.check_resources(cpus_per_trial=1, gpus_per_trial=0.5,
                                memory_per_trial_mb=None, max_concurrent=2, info=None)
    assert err.value.field == "resources.gpus_per_trial"
    assert "no GPU" in str(err.value) and "CUDA_VISIBLE_DEVICES" in str(err.value)
    with pytest.raises(UserInputError) as err:
        resources.check_resources(cpus_per_trial=1, gpus_per_trial=0.0,
                                memory_per_trial_mb=machine.memory_mb * 2, max_concurrent=2,
                                info=None)
    assert err.value.field == "resources.memory_per_trial_mb"
    assert time.monotonic() - start < FAST_S
    assert not ray.is_initialized()
    # What fits: concurrency is bounded by what the machine holds at once.
    assert resources.check_resources(cpus_per_trial=1, gpus_per_trial=0.0,
                                   memory_per_trial_mb=None, max_concurrent=1000,
                                   info=None) == int(machine.cpus)


def test_machine_detection_needs_neither_torch_nor_ray() -> None:
    code = ("import sys; from dpsweep.orchestrator.cluster import resources; "
            "resources.machine_resources(); "
            "sys.exit(bool({'torch', 'ray'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


def test_resource_checks_count_per_node_not_cluster_totals() -> None:
    nodes = (resources.NodeResources("a", "10.0.0.1", cpus=8, gpus=0, memory_mb=32000),
             resources.NodeResources("b", "10.0.0.2", cpus=2, gpus=2, memory_mb=8000))
    info = resources.ClusterInfo(address="10.0.0.1:6379", local=False, token_auth=True,
                               nodes=nodes, session_dir="/nonexistent")
    check = dict(memory_per_trial_mb=None, max_concurrent=100, info=info)
    assert resources.check_resources(cpus_per_trial=2, gpus_per_trial=0, **check) == 5
    assert resources.check_resources(cpus_per_trial=1, gpus_per_trial=0.5, **check) == 2
    with pytest.raises(UserInputError) as err:  # 10 CPUs in total, but never 9 on one node
        resources.check_resources(cpus_per_trial=9, gpus_per_trial=0, **check)
    assert err.value.field == "resources.cpus_per_trial" and "8 cpus on 10.0.0.1" in str(err.value)
    with pytest.raises(UserInputError) as err:  # CPUs on one node, GPUs on the other
        resources.check_resources(cpus_per_trial=4, gpus_per_trial=1, **check)
    assert err.value.field == "resources"
    with pytest.raises(UserInputError) as err:
        resources.check_resources(cpus_per_trial=1, gpus_per_trial=1.5, **check)
    assert err.value.field == "resources.gpus_per_trial" and "whole number" in str(err.value)
    with pytest.raises(UserInputError) as err:
        resources.check_resources(cpus_per_trial=1, gpus_per_trial=3, **check)
    assert err.value.field == "resources.gpus_per_trial"
    with pytest.raises(UserInputError) as err:
        resources.check_resources(cpus_per_trial=1, gpus_per_trial=0, memory_per_trial_mb=None,
                                max_concurrent=0, info=info)
    assert err.value.field == "sweep.max_concurrent_trials"


# --------------------------------------------------------------------------- connect


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http1_server() -> tuple[int, threading.Thread]:
    """A non-Ray service on loopback that answers one connection and stops by itself."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(FAST_S)

    def serve() -> None:
        with server:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


@pytest.mark.parametrize("address", ["closed", "http1", "not an address", "localhost:99999",
                                     "http://127.0.0.1:8265", "", "ray://127.0.0.1:closed"])
def test_bad_or_unreachable_address_fails_fast(address: str, clean_ray: None) -> None:
    thread = None
    if "closed" in address:
        address = f"127.0.0.1:{_closed_port()}" if address == "closed" else \
            address.replace("closed", str(_closed_port()))
    elif address == "http1":
        port, thread = _http1_server()
        address = f"127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(UserInputError) as err:
        cluster.connect(address, quiet=True)
    assert time.monotonic() - start < FAST_S, err.value
    assert err.value.field == "--address" and err.value.value == address
    assert not ray.is_initialized()
    if thread is not None:
        thread.join(FAST_S)
        assert "does not speak gRPC" in str(err.value)


# --------------------------------------------------------------------------- two nodes


def test_two_node_cluster_on_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      clean_ray: None) -> None:
    """A head and a worker node (separate raylets) on 127.0.0.1 with token auth."""
    from ray.cluster_utils import Cluster

    # Cluster records its address for every ray.init() on the machine; keep it to this test.
    monkeypatch.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
    monkeypatch.setattr(ray._common.utils, "reset_ray_address", lambda *a, **k: None)
    token = secrets.token_hex(32)
    monkeypatch.setenv(cluster.AUTH_MODE_ENV, "token")
    monkeypatch.setenv(cluster.AUTH_TOKEN_ENV, token)
    cluster._refresh_ray_auth_config()
    loopback = {"node_ip_address": resources.LOOPBACK_V4, "object_store_memory": 80 * 1024 ** 2,
                "temp_dir": str(raytemp.private_temp_dir())}
    # Fewer helper processes than a real head (no log monitor, autoscaler or dashboard): the
    # test is about the nodes, and every process costs seconds on a small machine.
    lean = {"include_dashboard": False, "include_log_monitor": False, "no_monitor": True}
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, **loopback, **lean},
                    shutdown_at_exit=True)
    try:
        nodes.add_node(num_cpus=1, num_gpus=1, **loopback)
        nodes.wait_for_nodes()

        # Without the token the connection is refused fast (Ray alone retries for ~20 s), and
        # the error says what to set.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        code = ("import sys, time, ray\n"
                "from dpsweep.orchestrator.cluster import connection as cluster\n"
                "t = time.monotonic()\n"
                "try: cluster.connect(sys.argv[1], quiet=True)\n"
                "except Exception as e: print(time.monotonic() - t, type(e).__name__, e); "
                "sys.exit(2)")
        proc = subprocess.run([sys.executable, "-c", code, nodes.address], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=90)
        assert proc.returncode == 2, proc.stderr[-2000:]
        seconds, message = proc.stdout.split(" ", 1)
        assert message.startswith("UserInputError --address") and "RAY_AUTH_TOKEN" in message
        assert float(seconds) < FAST_S

        with monkeypatch.context() as patch:  # as if this machine ran no node of the cluster
            patch.setattr(ray._private.services, "find_node_ids", lambda: [])
            start = time.monotonic()
            with pytest.raises(UserInputError, match="node on this machine"):
                cluster.connect(nodes.address, quiet=True)
            assert time.monotonic() - start < FAST_S  # ray.init would look for 60 s

        info = cluster.connect(nodes.address, quiet=True)
        assert not info.local and info.token_auth and len(info.nodes) == 2
        assert {n.address for n in info.nodes} == {resources.LOOPBACK_V4}
        assert sorted(n.cpus for n in info.nodes) == [1.0, 2.0]
        check = dict(memory_per_trial_mb=None, max_concurrent=16, info=info)
        assert resources.check_resources(cpus_per_trial=1, gpus_per_trial=0, **check) == 3
        assert resources.check_resources(cpus_per_trial=2, gpus_per_trial=0, **check) == 1
        assert resources.check_resources(cpus_per_trial=1, gpus_per_trial=1, **check) == 1
        with pytest.raises(UserInputError) as err:  # 3 CPUs in all, at most 2 on one node
            resources.check_resources(cpus_per_trial=3, gpus_per_trial=0, **check)
        assert err.value.field == "resources.cpus_per_trial"
        with pytest.raises(UserInputError) as err:  # the GPU node has 1 CPU only
            resources.check_resources(cpus_per_trial=2, gpus_per_trial=1, **check)
        assert err.value.field == "resources"

        assert storage.check_storage(tmp_path) == 2  # a probe ran on each node
        assert not (tmp_path / ".storage-probe").exists()
        exposed = [s for s in listening_sockets(os.getpid()) if not _is_loopback(s[3])]
        assert exposed == []
        cluster.shutdown()
        assert not ray.is_initialized()
    finally:
        tree = set(_process_tree(os.getpid())) - {os.getpid()}
        session_dir = nodes.head_node.get_session_dir_path()
        nodes.shutdown()
        monkeypatch.undo()
        cluster._refresh_ray_auth_config()  # this process follows the restored environment
    assert _wait_gone(tree) == set()
    shutil.rmtree(session_dir, ignore_errors=True)
