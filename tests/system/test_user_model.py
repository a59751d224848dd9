"""Your model, your data, end to end: a user's module and an ``.npz`` file, never installed.

* **CLI**: a module with ``build(input_shape, num_classes)`` (Conv2d, GroupNorm, Linear in an
  ``nn.Sequential``) next to the config, and the digits written as ``digits.npz``; a sweep over
  DP-SGD, LM-DP-SGD and DP-AdamILG with the membership audit inside every trial. One row per
  trial with a valid epsilon, per-layer attack rows for each of the user's layers by name, and
  an export whose weights load into a fresh module from the factory with the recorded test
  accuracy.
* **Python API**: the same factory passed as a callable to ``api.run``.
* **Two nodes**: the same config against a two-node loopback cluster, run from another folder:
  the module reaches the workers only through Ray's runtime environment.

The CLI sweep starts in the background with the module's first test, and the Python API and
two-node sweeps run meanwhile (one after the other: both change this process's environment);
the CLI sweep's tests come last.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from dpsweep.reports.store import read_results

#: Every test starts the CLI sweep (``cli_sweep``) if it is not running yet.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cli_sweep")]

BIN = Path(sys.executable).parent / "dpsweep"
TIMEOUT = 600
MODULE = '''\
import os
from collections import OrderedDict

from torch import nn


def build(input_shape, num_classes, width=8):
    origins = os.environ.get("USER_NET_ORIGINS")
    if origins:  # where each process imported this file from (the two-node test reads it)
        with open(origins, "a") as out:
            out.write(os.path.dirname(os.path.abspath(__file__)) + "\\n")
    channels, height, side = input_shape
    return nn.Sequential(OrderedDict(
        features=nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.GroupNorm(2, width),
                               nn.Tanh(), nn.AvgPool2d(2)),
        hidden=nn.Sequential(nn.Flatten(), nn.Linear(width * (height // 2) * (side // 2), 32),
                             nn.Tanh()),
        head=nn.Linear(32, num_classes),
    ))
'''
CONFIG = """\
[data]
dataset = "file"
path = "digits.npz"
[model]
factory = "{module}:build"
args = {{width = 8}}
[training]
epochs = {epochs}
batch_size = 50
[sweep]
methods = ["dpsgd", "lm_dpsgd", "dp_adamilg"]
trials_per_method = 1
max_concurrent_trials = 2
baseline = false
[audit]
enabled = {audit}
in_trial = true
reference_models = 4
layer_probes = false
"""
LAYERS = ["features", "hidden", "head"]
IDS = ["dp_adamilg_eps3-000", "dpsgd_eps3-000", "lm_dpsgd_eps3-000"]


def _user_folder(root: Path, module: str, *, audit: bool) -> Path:
    """A folder as a user has it: their module, their data, their config."""
    from sklearn.datasets import load_digits

    root.mkdir(parents=True)
    (root / f"{module}.py").write_text(MODULE)
    digits = load_digits()
    np.savez(root / "digits.npz", x=digits.images.reshape(-1, 1, 8, 8).astype(np.float32),
             y=digits.target.astype(np.int64))
    (root / "sweep.toml").write_text(CONFIG.format(module=module, epochs=2 if audit else 1,
                                                   audit="true" if audit else "false"))
    return root


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the user's module is found through the config only
    return env


def _assert_rows(run: Path) -> pd.DataFrame:
    frame = read_results(run)
    assert sorted(frame["trial_id"]) == IDS
    assert (frame["status"] == "ok").all(), frame[["trial_id", "error"]]
    assert (frame["epsilon_upper"] <= frame["target_epsilon"]).all()
    assert frame["dp_valid"].all()
    return frame


@dataclass
class _Command:
    """A command running in the background in a session of its own, its output in files."""

    popen: subprocess.Popen
    out: Path
    err: Path

    @classmethod
    def start(cls, args: list[str], *, cwd: Path, logs: Path) -> _Command:
        out, err = logs / "stdout", logs / "stderr"
        with out.open("w") as fo, err.open("w") as fe:
            popen = subprocess.Popen(args, cwd=cwd, env=_env(), stdout=fo, stderr=fe,
                                     start_new_session=True)
        return cls(popen, out, err)

    def wait(self, timeout: float) -> int | None:
        """The exit code; None when it did not end within ``timeout`` (then it is killed)."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")


@pytest.fixture(scope="module")
def cli_sweep(tmp_path_factory: pytest.TempPathFactory,
              request: pytest.FixtureRequest) -> Iterator[tuple[Path, _Command] | None]:
    """The CLI sweep, started in the background when the module's first test starts (every
    test asks for it): the Python API and two-node sweeps run while it does, and the tests of
    its results, last in the module, wait for it (``cli_run``). None (nothing started) when no
    test of the session reads it."""
    if not any("cli_run" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    folder = _user_folder(tmp_path_factory.mktemp("user") / "project", "user_net", audit=True)
    elsewhere = tmp_path_factory.mktemp("cwd")
    command = _Command.start([str(BIN), "run", str(folder / "sweep.toml"), "--out",
                              str(folder / "runs" / "one"), "--quiet"], cwd=elsewhere,
                             logs=tmp_path_factory.mktemp("cli-logs"))
    try:
        yield folder, command
    finally:
        command.stop()


@pytest.fixture(scope="module")
def cli_run(cli_sweep: tuple[Path, _Command] | None) -> Path:
    assert cli_sweep is not None
    folder, command = cli_sweep
    rc = command.wait(TIMEOUT)
    assert rc == 0, command.stderr()[-3000:]
    return folder / "runs" / "one"


def test_the_factory_as_a_python_callable(tmp_path: Path) -> None:
    from dpsweep.orchestrator import api
    from dpsweep.orchestrator.config import read_toml

    folder = _user_folder(tmp_path / "api", "api_net", audit=False)
    sys.path.insert(0, str(folder))
    try:
        build = importlib.import_module("api_net").build
        raw = read_toml(folder / "sweep.toml")
        del raw["model"]["factory"]  # the callable is the model
        cfg = api.from_dict(raw, base_dir=folder, model=build)
        summary = api.run(cfg, out=tmp_path / "run")
    finally:
        sys.path.remove(str(folder))
    assert summary.rows == len(IDS)
    _assert_rows(tmp_path / "run")
    spec = json.loads((tmp_path / "run" / "trials" / IDS[0] / "spec.json").read_text())
    assert spec["user_model"]["factory"] == "api_net:build"
    assert Path(spec["user_model"]["code_dir"]) == folder.resolve()


def test_the_same_config_on_two_nodes_ships_the_code_through_ray(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Workers import the module from Ray's copy of the config's folder, not from the folder."""
    import secrets

    import ray
    from ray.cluster_utils import Cluster

    from dpsweep.orchestrator.cluster import connection as cluster
    from dpsweep.orchestrator.raytemp import private_temp_dir

    folder = _user_folder(tmp_path / "project", "node_net", audit=False)
    origins = tmp_path / "origins.txt"
    # Cluster records its address for every ray.init() on the machine; keep it to this test.
    monkeypatch.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
    monkeypatch.setattr(ray._common.utils, "reset_ray_address", lambda *a, **k: None)
    token = {cluster.AUTH_MODE_ENV: "token", cluster.AUTH_TOKEN_ENV: secrets.token_hex(32)}
    for key, value in {**token, "USER_NET_ORIGINS": str(origins)}.items():
        monkeypatch.setenv(key, value)  # the nodes' workers inherit these
    cluster._refresh_ray_auth_config()
    loopback = {"node_ip_address": cluster.LOOPBACK_V4,
                "temp_dir": str(private_temp_dir())}
    lean = {"include_dashboard": False, "include_log_monitor": False, "no_monitor": True}
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **loopback, **lean},
                    shutdown_at_exit=True)
    try:
        nodes.add_node(num_cpus=1, **loopback)
        nodes.wait_for_nodes()
        proc = subprocess.run([str(BIN), "run", str(folder / "sweep.toml"), "--out",
                               str(tmp_path / "run"), "--address", nodes.address, "--quiet"],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=TIMEOUT)
    finally:
        nodes.shutdown()
        monkeypatch.undo()
        cluster._refresh_ray_auth_config()
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_rows(tmp_path / "run")
    seen = set(origins.read_text().split())
    assert str(folder.resolve()) in seen  # the driver validated the config from the folder
    shipped = seen - {str(folder.resolve())}
    assert shipped and all("working_dir_files" in s for s in shipped), seen


def test_every_trial_has_a_row_with_the_users_layers_attacked(cli_run: Path) -> None:
    _assert_rows(cli_run)
    layers = pd.read_csv(cli_run / "report" / "mia_layers.csv")
    for trial_id in IDS:
        named = set(layers.loc[layers["trial_id"] == trial_id, "layer"])
        assert set(LAYERS) <= named, (trial_id, named)
    spec = json.loads((cli_run / "trials" / IDS[1] / "spec.json").read_text())
    assert spec["user_model"]["factory"] == "user_net:build"
    manifest = json.loads((cli_run / "manifest.json").read_text())
    assert set(manifest["inputs"]) == {"model_code", "data.path"}
    from dpsweep.orchestrator.cli import main

    assert main(["pick", str(cli_run)]) == 0  # its retrain config names the user's network
    assert 'factory = "user_net:build"' in (cli_run / "pick_config.toml").read_text()


def test_the_export_loads_into_the_factorys_module_with_the_recorded_accuracy(
        cli_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dpsweep.orchestrator.cli import main
    from dpsweep.trainables.training.loop import load_spec, load_trial_data

    trial = "dpsgd_eps3-000"
    assert main(["export", str(cli_run), "--trial", trial, "--out", str(tmp_path / "rel")]) == 0
    info = json.loads((tmp_path / "rel" / "model.json").read_text())
    assert info["layers"] == LAYERS and len(info["code_sha256"]) == 64
    code_dir = str(tmp_path / "rel" / info["model_source"]["code_dir"])  # the export's copy
    assert info["code"]["files"] == {"user_net.py": info["code"]["files"]["user_net.py"]}
    sys.modules.pop("user_net", None)  # imported from the project folder by the run
    sys.path.insert(0, code_dir)
    try:
        build = importlib.import_module("user_net").build
    finally:
        sys.path.remove(code_dir)
    net = build(input_shape=tuple(info["input_shape"]), num_classes=info["num_classes"],
                **info["model_source"]["args"])
    net.load_state_dict(torch.load(tmp_path / "rel" / "weights.pt", weights_only=True))
    spec = load_spec(json.loads((cli_run / "trials" / trial / "spec.json").read_text()))
    test = load_trial_data(spec).test
    with torch.no_grad():
        accuracy = float((net.eval()(test.x).argmax(1) == test.y).float().mean())
    recorded = float(read_results(cli_run).set_index("trial_id").loc[trial, "test_accuracy"])
    assert abs(accuracy - recorded) <= 1.0 / len(test.y)
