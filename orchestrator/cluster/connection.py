"""A loopback-only local Ray, an honest cluster connection, and the environment both set.

Why this module exists (measured with Ray 2.60 on Linux, see docs/security.md):

* ``ray.init(_node_ip_address="127.0.0.1")`` does not keep a local Ray on loopback: Ray rewrites
  a loopback node address to the machine's routable one (``resolve_ip_for_localhost``), and every
  gRPC server (GCS, raylet, workers, the driver) then binds the wildcard address. Ray's own
  local-only mode (the one it uses on macOS and Windows, ``ENABLE_RAY_CLUSTER`` off) keeps the
  node address at 127.0.0.1, and every Ray server binds loopback when the node address is
  loopback. :func:`start_local` turns that mode on for the duration of ``ray.init`` only.
* ``ray.init()`` without an address silently *joins* the newest cluster recorded in
  ``/tmp/ray/ray_current_cluster`` (any ``ray start`` on the machine); :func:`start_local`
  passes ``address="local"`` so a local run is always its own.
* ``ray.init(address=...)`` to a closed port on 127.0.0.1 retries for more than five minutes
  (20 attempts of 40 s); :func:`connect` probes the address first (TCP, then the HTTP/2
  greeting every gRPC server sends) and bounds Ray's own retries. The same checks run before a
  sweep writes anything (:func:`check_address`).
* Under a long TMPDIR Ray's Unix socket paths exceed 107 bytes; a local Ray's temp dir is kept
  short and private (``orchestrator.raytemp``).

Token authentication stays on for a local run (loopback is reachable by every local user and
container sharing the network namespace); the token is a fresh random one per run, passed to
Ray's processes through the environment, never written to disk or put on a command line.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray._private.worker as ray_worker
from ray._private import ray_constants, services
from ray._private import utils as ray_utils
from ray._raylet import (
    AuthenticationMode,
    AuthenticationTokenLoader,
    Config,
    InnerGcsClient,
    get_authentication_mode,
)
from ray.core.generated.gcs_pb2 import GcsNodeInfo

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.cluster.resources import (
    ADDRESS_FIELD,
    LOOPBACK_V4,
    MIB,
    ClusterInfo,
    NodeResources,
    usable_cpus,
)
from dpsweep.orchestrator.config.paths import CODE_EXCLUDES
from dpsweep.orchestrator.raytemp import private_temp_dir

_log = logging.getLogger("dpsweep.cluster")

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
CLIENT_SCHEME = "ray://"
AUTO_ADDRESS = "auto"
# Ray refuses GCS ports outside this range (services.extract_ip_port).
GCS_PORT_RANGE = (1024, 65535)
ANY_PORT_RANGE = (1, 65535)
# The TCP connect and the HTTP/2 greeting each get this long: a live GCS answers in milliseconds.
CONNECT_PROBE_TIMEOUT_S = 5.0
# ray.init's connection attempts, about 1 s each once the probe has seen the port speak gRPC
# (Ray's default is 20; a wrong or missing token fails every one of them).
GCS_CONNECT_ATTEMPTS = 3
TOKEN_HEX_BYTES = 32  # 256 bits, the size Ray generates itself

# Ray's environment switches this module sets (and restores on shutdown).
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
USE_TLS_ENV = "RAY_USE_TLS"
USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"

# The client greeting of HTTP/2 (RFC 9113 3.4) and an empty SETTINGS frame; a gRPC server must
# answer with its own SETTINGS frame (type 4) before anything else.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_FRAME_HEADER = 9
_H2_SETTINGS = 0x04
_AUTH_FAILURE_MARKERS = ("InvalidAuthToken", "Authentication token", "AuthenticationError")


@dataclass
class _State:
    """What this module changed, so :func:`shutdown` undoes exactly that."""

    owner: str | None = None  # "local" or "cluster" while attached through this module
    saved_env: dict[str, str | None] | None = None
    atexit_registered: bool = False


_state = _State()


# --------------------------------------------------------------------------- local Ray


def start_local(*, num_cpus: int | None, num_gpus: float | None, quiet: bool,
                runtime_env: dict[str, Any] | None = None) -> ClusterInfo:
    """Start a private Ray on this machine whose every listening socket is on 127.0.0.1.

    ``num_cpus=None`` gives Ray the CPUs this process may use (affinity and cgroup quota, which
    Ray itself does not read); ``num_gpus=None`` lets Ray detect GPUs.
    """
    if num_cpus is not None and (isinstance(num_cpus, bool) or not isinstance(num_cpus, int)
                                 or num_cpus < 1):
        raise UserInputError(field="num_cpus", value=num_cpus, allowed="an integer >= 1 or None")
    if num_gpus is not None and (isinstance(num_gpus, bool)
                                 or not isinstance(num_gpus, (int, float))
                                 or not math.isfinite(num_gpus) or num_gpus < 0):
        raise UserInputError(field="num_gpus", value=num_gpus, allowed="a number >= 0 or None")
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; call "
                           "orchestrator.cluster.connection.shutdown() (or ray.shutdown()) first")
    _save_env()
    token_auth = _configure_local_auth()
    # ray.init turns usage stats off for a local cluster already; said explicitly, it holds for
    # nightly wheels too and for every process Ray starts (they inherit the environment).
    os.environ[USAGE_STATS_ENV] = "0"
    _register_atexit()
    _state.owner = "local"  # from here on shutdown() stops whatever part of Ray came up
    try:
        with _loopback_node_address():
            ray.init(address="local", num_cpus=num_cpus or usable_cpus(), num_gpus=num_gpus,
                     include_dashboard=False, _temp_dir=str(private_temp_dir()),
                     **_init_kwargs(quiet=quiet, runtime_env=runtime_env))
        _route_raylet_messages()
        info = _describe(local=True, token_auth=token_auth)
        outside = [n.address for n in info.nodes if n.address != LOOPBACK_V4]
        if outside:  # Ray changed how it picks the node address: refuse rather than expose it
            raise RuntimeError(f"local Ray came up on {outside}, not {LOOPBACK_V4}; refusing "
                               "to run with sockets outside loopback")
        return info
    except BaseException:
        shutdown()
        raise


def shutdown() -> None:
    """Stop the Ray :func:`start_local` started (or leave the cluster :func:`connect` joined).

    Idempotent, and also run at exit: Ray turns SIGTERM into ``SystemExit``, so a signalled run
    ends here too (a SIGKILLed driver's Ray processes are reaped by Ray's fate sharing). A Ray
    initialised by someone else is left alone.
    """
    _shutdown(refresh_config=True)


def _shutdown(*, refresh_config: bool) -> None:
    if _state.owner is not None:
        if ray.is_initialized():
            ray.shutdown()
        _state.owner = None
    if _state.saved_env is not None:
        for key, value in _state.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _state.saved_env = None
        if refresh_config:  # pointless at exit, and Ray's threads may still be draining then
            _refresh_ray_auth_config()


def _shutdown_at_exit() -> None:
    _shutdown(refresh_config=False)


# --------------------------------------------------------------------------- existing cluster


def connect(address: str, *, quiet: bool,
            runtime_env: dict[str, Any] | None = None) -> ClusterInfo:
    """Join a running cluster (``--address`` / RAY_ADDRESS): ``host:port``, ``auto`` or ``ray://``.

    Every failure is one :class:`UserInputError` naming ``--address``, within seconds: the
    address is probed before Ray's own (minutes-long) retry loop can start.
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; call "
                           "orchestrator.cluster.connection.shutdown() (or ray.shutdown()) first")
    target = _checked_target(address)
    if isinstance(target, str):
        return _connect_client(target, quiet=quiet, runtime_env=runtime_env)
    host, port = target
    _save_env()
    os.environ[GCS_WAIT_ENV] = str(GCS_CONNECT_ATTEMPTS)
    _register_atexit()
    _state.owner = "cluster"
    try:
        with _loopback_node_address(enabled=host in LOOPBACK_HOSTS):
            ray.init(address=f"{_bracket(host)}:{port}",
                     **_init_kwargs(quiet=quiet, runtime_env=runtime_env))
        _route_raylet_messages()
    except Exception as exc:
        shutdown()
        raise _connect_failure(address, exc) from None
    _restore_env(GCS_WAIT_ENV)  # only ray.init's own connection needs the short retry budget
    return _describe(local=False, token_auth=_auth_mode_is_token())


def check_address(address: str) -> None:
    """Refuse, in seconds and before anything is written, an address :func:`connect` would
    refuse: its form, its host, a gRPC server at its port, the Ray Client package for ray://,
    and for a GCS the GCS itself and a node on this machine. (A sweep created its run directory
    first and then met the address: a directory that refused ``run`` and needed ``resume``.)"""
    _checked_target(address)


def _checked_target(address: str) -> tuple[str, int] | str:
    """The GCS's (host, port), or the ray:// address, once every check has passed."""
    text = address.strip() if isinstance(address, str) else ""
    if not text:
        raise _address_error(address, "host:port of a running Ray cluster's GCS (`ray start "
                                      "--head` prints it), 'auto', or ray://host:port")
    if text.startswith(CLIENT_SCHEME):
        if ray_utils.get_ray_client_dependency_error() is not None:
            raise _address_error(text, "a host:port GCS address: ray:// (Ray Client) addresses "
                                       "need `pip install 'ray[client]'` (grpcio), not installed")
        host, port = _split_host_port(text[len(CLIENT_SCHEME):], original=text,
                                      ports=ANY_PORT_RANGE)
        _probe_grpc(host, port, original=text)
        return text
    if text == AUTO_ADDRESS:
        text = _resolve_auto(address)
    host, port = _split_host_port(text, original=address, ports=GCS_PORT_RANGE)
    _probe_grpc(host, port, original=address)
    _refresh_ray_auth_config()  # the environment may have changed since Ray was imported
    _check_gcs_and_local_node(f"{_resolve_loopback(host)}:{port}", original=address)
    return host, port


def _check_gcs_and_local_node(gcs_address: str, *, original: str) -> None:
    """Ask the GCS itself, with a deadline, before ray.init retries without one.

    A driver attaches to a Ray node running on its own machine; ray.init looks for one for 60 s
    before saying so, and retries a missing token 20 times: both are answered here at once.
    """
    try:
        gcs = InnerGcsClient.standalone(gcs_address, None, int(CONNECT_PROBE_TIMEOUT_S * 1000))
        alive = gcs.get_all_node_info(timeout=CONNECT_PROBE_TIMEOUT_S,
                                      state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
    except Exception as exc:
        raise _connect_failure(original, exc) from None
    cluster_nodes = {node_id.hex() for node_id in alive}
    if not cluster_nodes & set(services.find_node_ids()):
        raise _address_error(original, "a cluster with a node on this machine: a Ray driver "
                                       "attaches to a local node (run dpsweep on the head node, "
                                       "or `ray start --address=...` here first)")


def _resolve_loopback(host: str) -> str:
    """The address Ray will use for a loopback host once local-only mode keeps it loopback."""
    return "[::1]" if host == "::1" else LOOPBACK_V4 if host in LOOPBACK_HOSTS else _bracket(host)


def _connect_client(text: str, *, quiet: bool,
                    runtime_env: dict[str, Any] | None = None) -> ClusterInfo:
    """A Ray Client address (checked: ``ray[client]``, which dpsweep does not require, is
    installed and the port speaks gRPC)."""
    _save_env()
    _register_atexit()
    _state.owner = "cluster"
    try:
        ray.init(address=text, logging_level="ERROR" if quiet else "WARNING",
                 **({"runtime_env": runtime_env} if runtime_env else {}))
    except Exception as exc:
        shutdown()
        raise _connect_failure(text, exc) from None
    return _describe(local=False, token_auth=_auth_mode_is_token())


def _resolve_auto(original: str) -> str:
    try:
        return services.canonicalize_bootstrap_address_or_die(AUTO_ADDRESS)
    except ConnectionError as exc:
        raise _address_error(original, f"a running Ray cluster on this machine ({exc})") from None


def _split_host_port(text: str, *, original: str, ports: tuple[int, int]) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; Ray's own parser accepts less and explains less."""
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
    else:
        host, sep, port_text = text.rpartition(":")
    low, high = ports
    bad_host = not host or "/" in host or (":" in host and not text.startswith("["))
    if not sep or bad_host or not port_text.isdigit() or not low <= int(port_text) <= high:
        raise _address_error(original, f"host:port with a port in {low}..{high} (IPv6 as "
                                       "[addr]:port), 'auto', or ray://host:port")
    return host, int(port_text)


def _probe_grpc(host: str, port: int, *, original: str) -> None:
    """Fail in seconds where Ray would retry for minutes: DNS, closed port, non-gRPC service."""
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_PROBE_TIMEOUT_S)
    except socket.gaierror as exc:
        raise _address_error(original, f"a resolvable host ({exc.strerror})") from None
    except TimeoutError:
        raise _address_error(original, f"an address answering within {CONNECT_PROBE_TIMEOUT_S:g}"
                                       " s (nothing answered: host down or firewalled?)") from None
    except OSError as exc:
        raise _address_error(original, "the address of a running Ray cluster (connecting "
                                       f"failed: {exc.strerror or exc})") from None
    with sock:
        if _truthy(os.environ.get(USE_TLS_ENV)):
            return  # a TLS server waits for our handshake: the TCP accept is all we can check
        try:
            sock.sendall(_H2_PREFACE)
            head = _recv_exactly(sock, _H2_FRAME_HEADER)
        except OSError:  # includes the timeout of a listener that never answers
            head = b""
    if len(head) < _H2_FRAME_HEADER or head[3] != _H2_SETTINGS:
        raise _address_error(original, "the port of a Ray cluster (the service at that port "
                                       "does not speak gRPC)")


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _connect_failure(original: str, exc: BaseException) -> UserInputError:
    chain = []
    cause: BaseException | None = exc
    while cause is not None and len(chain) < 8:
        chain.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    text = " ".join(" | ".join(chain).split())
    if any(marker in text for marker in _AUTH_FAILURE_MARKERS):
        return _address_error(original, "a cluster whose authentication token this process "
                                        f"has: set {AUTH_MODE_ENV}=token and {AUTH_TOKEN_ENV} "
                                        f"(or {AUTH_TOKEN_PATH_ENV}) to the token of the cluster "
                                        "(`ray get-auth-token` on its head node)")
    return _address_error(original, f"the address of a running Ray cluster ({text[:400]})")


def _address_error(value: Any, allowed: str) -> UserInputError:
    return UserInputError(field=ADDRESS_FIELD, value=value, allowed=allowed)


# --------------------------------------------------------------------------- Ray plumbing


def _route_raylet_messages() -> None:
    """Ray prints the raylet's error messages (a worker that died, a task that failed) straight
    to the driver's stderr, whatever ``log_to_driver`` says; dpsweep records each trial's failure
    with its reason, so those lines go to this module's log instead of the user's terminal."""
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_dpsweep_routed", False):
        return

    def routed(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        if data.get("pid") == "raylet":
            _log.info("raylet: %s", " ".join(map(str, data.get("lines", []))))
            return
        original(data, ignore_prefix)

    routed._dpsweep_routed = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = routed


def _init_kwargs(*, quiet: bool, runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"log_to_driver": False, "configure_logging": True,
                           "logging_level": "ERROR" if quiet else "WARNING"}
    if runtime_env:
        out["runtime_env"] = runtime_env
    return out


#: Set by Ray's job manager for a ``ray job submit`` driver: the job's runtime environment.
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _job_working_dir() -> bool:
    """Whether this driver runs inside a Ray job that ships a working directory already."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return False
    try:
        env = (json.loads(raw).get("runtime_env") or {})
    except (ValueError, AttributeError):
        return False
    return bool(isinstance(env, dict) and env.get("working_dir"))


def code_runtime_env(code_dir: str, *, skip: list[Path]) -> dict[str, Any] | None:
    """Ray's runtime environment that puts the user's code folder on every worker (uploaded
    once; each worker imports from its copy). ``skip`` are folders inside it not to upload (the
    run directory itself).

    Inside a ``ray job submit --working-dir`` job the job's working directory already reaches
    every worker (and Ray refuses a second one): the code folder must then be that directory,
    which is where the job runs."""
    root = Path(code_dir).resolve()
    if _job_working_dir():
        if root != Path.cwd().resolve():
            raise UserInputError(field="model.code_dir", value=str(root),
                                 allowed="the job's --working-dir (inside `ray job submit` only "
                                         "that folder reaches the workers: put your module "
                                         "and the config at its top)")
        return None
    excludes = list(CODE_EXCLUDES)
    for folder in skip:
        folder = folder.resolve()
        if folder != root and root in folder.parents:
            excludes.append("/" + str(folder.relative_to(root)))
    return {"working_dir": str(root), "excludes": excludes}


@contextmanager
def _loopback_node_address(*, enabled: bool = True) -> Iterator[None]:
    """Ray's local-only mode while ``ray.init`` runs: a loopback address stays loopback.

    ``services.get_node_ip_address`` and ``resolve_ip_for_localhost`` read this flag at call
    time; Ray's processes get the node address on their command line, so restoring it after
    ``ray.init`` changes nothing for them.
    """
    before = ray_constants.ENABLE_RAY_CLUSTER
    if enabled:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _configure_local_auth() -> bool:
    """Token auth on, with a fresh per-run token, unless the user chose otherwise.

    Saying ``RAY_AUTH_MODE=token`` explicitly is what keeps Ray from warning on every run; an
    explicit ``RAY_AUTH_MODE=disabled`` or a token of the user's own is respected.
    """
    if os.environ.get(AUTH_MODE_ENV) is None:
        os.environ[AUTH_MODE_ENV] = "token"
    token_auth = os.environ[AUTH_MODE_ENV].lower() == "token"
    if token_auth and not (os.environ.get(AUTH_TOKEN_ENV) or os.environ.get(AUTH_TOKEN_PATH_ENV)):
        # In the environment, not ~/.ray/auth_token: nothing persists after the run, and Ray's
        # processes (same user) inherit it; it is never on a command line.
        os.environ[AUTH_TOKEN_ENV] = secrets.token_hex(TOKEN_HEX_BYTES)
    _refresh_ray_auth_config()
    return token_auth


def _refresh_ray_auth_config() -> None:
    """Make this process's cached Ray config and token follow the environment again.

    Ray reads ``RAY_AUTH_MODE`` once per process (its own tests refresh it the same way); the
    config is refreshed before the token cache is dropped, as Ray's test utilities do.
    """
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _auth_mode_is_token() -> bool:
    return get_authentication_mode() == AuthenticationMode.TOKEN


def _save_env() -> None:
    if _state.saved_env is None:
        keys = (AUTH_MODE_ENV, AUTH_TOKEN_ENV, GCS_WAIT_ENV, USAGE_STATS_ENV)
        _state.saved_env = {key: os.environ.get(key) for key in keys}


def _restore_env(key: str) -> None:
    saved = (_state.saved_env or {}).get(key)
    if saved is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = saved


def _register_atexit() -> None:
    if not _state.atexit_registered:
        atexit.register(_shutdown_at_exit)
        _state.atexit_registered = True


def _describe(*, local: bool, token_auth: bool) -> ClusterInfo:
    nodes = tuple(
        NodeResources(node_id=n["NodeID"], address=n["NodeManagerAddress"],
                      cpus=float(n["Resources"].get("CPU", 0.0)),
                      gpus=float(n["Resources"].get("GPU", 0.0)),
                      memory_mb=float(n["Resources"].get("memory", 0.0)) / MIB)
        for n in ray.nodes() if n.get("Alive"))
    return ClusterInfo(address=ray.get_runtime_context().gcs_address, local=local,
                       token_auth=token_auth, nodes=nodes,
                       session_dir=ray._private.worker._global_node.get_session_dir_path())


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- resources
