"""Bad input, command by command: exit code 2, exactly one line on stderr naming the field, the
value and what is allowed, no traceback, and nothing written.

The table runs each case in-process (``orchestrator.cli.main``); a few run end to end through
the installed ``dpsweep`` script in a subprocess. Every case snapshots the directories it could
write to (its whole temporary directory: config, ``--out`` targets, run-directory copies) and
compares them afterwards, byte for byte. Commands that hold a run directory's lock while they
validate (``resume``, ``audit``) may refresh the lock's bookkeeping files, nothing else.

Run directories are real ones, written by ``dpsweep train``'s own code
(``orchestrator.trial.single.train_single``), then damaged per case: a missing manifest, an edited
results store or privacy record, a crafted pickle where a run directory keeps state, a corrupt
checkpoint. A crafted pickle creates a marker file if it is ever unpickled; the marker must
never appear.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest

from dpsweep.core import layout
from dpsweep.core.layout import LOCK, LOCK_INFO, MANIFEST
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.trial.single import train_single
from dpsweep.reports import store
from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
DPSWEEP = Path(sys.executable).parent / "dpsweep"
TRIAL = "trial-000"  # orchestrator.trial.single.TRIAL_ID
STATE = f"trials/{TRIAL}/checkpoint/state.pt"
PRIVACY = f"trials/{TRIAL}/privacy.json"
PREFIX = "dpsweep: error: "
SEPARATOR = " is not allowed: expected "


# ---- run directories ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Runs:
    secret: Path  # a release-safe single-trial run directory
    replayable: Path  # the same with reproducible (seeded) randomness


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("pristine")
    train_single(check(tiny_config()), out=base / "secret")
    train_single(check(tiny_config(reproducible=True)), out=base / "replayable")
    return Runs(secret=base / "secret", replayable=base / "replayable")


class _Unpickled:
    """Creates ``marker`` when unpickled: ``open(marker, "w")``, no shell needed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (str(self.marker), "w"))


@dataclass
class Ctx:
    """One case's world: a temporary directory and helpers that build its inputs there."""

    tmp: Path
    runs: Runs
    monkeypatch: pytest.MonkeyPatch
    marker: Path = field(init=False)

    def __post_init__(self) -> None:
        self.marker = self.tmp / "PICKLE-WAS-EXECUTED"

    def config(self, text: str, name: str = "c.toml") -> str:
        path = self.tmp / name
        path.write_text(text)
        return str(path)

    def path(self, name: str) -> str:
        return str(self.tmp / name)

    def run(self, which: str = "secret", name: str = "run") -> Path:
        """A private copy of a pristine run directory."""
        target = self.tmp / name
        shutil.copytree(getattr(self.runs, which), target, symlinks=True)
        return target

    def rerecord(self, run: Path, rels: list[str]) -> None:
        """Update the manifest as an attacker with write access would (hashes match again)."""
        with RunDir.open(run, write=True) as opened:
            opened.record(rels)

    def audited(self, name: str = "run") -> Path:
        """A run copy whose trial carries audit results, so that `pick` can choose it."""
        run = self.run(name=name)
        frame = store.read_results(run)
        frame.loc[0, ["peak_mia_accuracy", "peak_mia_upper"]] = [0.55, 0.6]
        frame.loc[0, "val_accuracy"] = max(float(frame.loc[0, "val_accuracy"]), 0.9)
        frame.loc[0, "degenerate"] = False
        store.write_results(run, frame.to_dict("records"))
        self.rerecord(run, [layout.RESULTS])
        return run

    def evil_pickle(self, run: Path, rel: str) -> None:
        target = run / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(pickle.dumps(_Unpickled(self.marker)))


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Ctx], list[str]]  # builds the case's inputs, returns the arguments
    field: str | tuple[str, ...]  # the field the line names (alternatives: any of them)
    value: str  # text of the offending value the line shows
    allowed: str  # fragment of what the line says is allowed

    @property
    def fields(self) -> tuple[str, ...]:
        return self.field if isinstance(self.field, tuple) else (self.field,)


def _cfg(text: str, command: str = "check") -> Callable[[Ctx], list[str]]:
    """A config error through `config --check`, `train --out` or `run --out`."""
    def argv(ctx: Ctx) -> list[str]:
        path = ctx.config(text)
        if command == "check":
            return ["config", "--check", path]
        return [command, path, "--out", ctx.path("out")]
    return argv


def _no_gpu(text: str, command: str = "check") -> Callable[[Ctx], list[str]]:
    """A config checked (or trained) on a machine whose GPUs are hidden (CUDA_VISIBLE_DEVICES
    empty), so the case is the same on a GPU host."""
    def argv(ctx: Ctx) -> list[str]:
        ctx.monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        return _cfg(text, command)(ctx)
    return argv


GOOD = "[training]\nepochs = 1\n"
FMNIST_MISSING = "[data]\ndataset = 'fashion-mnist'\ndata_dir = '{tmp}/empty'\n"


def _missing_data(command: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        (ctx.tmp / "empty").mkdir()
        path = ctx.config(FMNIST_MISSING.format(tmp=ctx.tmp))
        return ["config", "--check", path] if command == "check" else [
            command, path, "--out", ctx.path("out")]
    return argv


def _mnist_not_downloaded(ctx: Ctx) -> list[str]:
    (ctx.tmp / "cache").mkdir()
    ctx.monkeypatch.setenv("DPSWEEP_DATA_DIR", str(ctx.tmp / "cache"))
    return ["config", "--check", ctx.config("[data]\ndataset = 'mnist'\n")]


#: A user's module with every case's factory: each builds a small network for 8x8 digits.
USER_MODULE = """\
from torch import nn


class Net(nn.Module):
    def __init__(self, extra=False):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh())
        self.head = nn.Linear(16, 10)
        if extra:
            self.scale = nn.Parameter(nn.init.ones_(nn.Linear(1, 1).weight))

    def forward(self, x):
        return self.head(self.body(x)) * (self.scale if hasattr(self, "scale") else 1.0)


def good(input_shape, num_classes):
    return Net()


def batchnorm(input_shape, num_classes):
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh(),
                         nn.Flatten(), nn.Linear(8 * 64, num_classes))


def stray(input_shape, num_classes):
    return Net(extra=True)


def frozen(input_shape, num_classes):
    return Net().requires_grad_(False)


def weighted(input_shape, num_classes, weights=""):
    return Net()  # a pretrained backbone's weights file would be read here


def frozen_body(input_shape, num_classes):
    net = Net()
    net.body.requires_grad_(False)  # a frozen backbone: the head is the one trained layer
    return net


def raises(input_shape, num_classes):
    raise RuntimeError("no such width")


def not_a_module(input_shape, num_classes):
    return "Net"
"""


def _weights_beside_the_factory(ctx: Ctx) -> list[str]:
    """A weights file beside the factory, named relative to it in ``[model] args``."""
    argv = _user("weighted")(ctx)
    (ctx.tmp / "backbone.pt").write_bytes(b"weights")
    config = Path(argv[-1])
    config.write_text(config.read_text().replace(
        "factory = 'user_net:weighted'\n",
        "factory = 'user_net:weighted'\nargs = {weights = 'backbone.pt'}\n"))
    return argv


def _user(model: str = "", data: str = "", rows: Callable[..., object] | None = None,
          command: str = "check", table: bool = False,
          layers: str = "", fix: str = "") -> Callable[[Ctx], list[str]]:
    """A user's project: ``user_net.py`` next to the config, and the digits as ``digits.npz``
    (or ``digits.csv`` with ``table``), damaged by ``rows(x, y)`` first."""
    def argv(ctx: Ctx) -> list[str]:
        import numpy as np
        from sklearn.datasets import load_digits

        (ctx.tmp / "user_net.py").write_text(USER_MODULE)
        digits = load_digits()
        x, y = digits.images.reshape(-1, 1, 8, 8).astype(np.float32), digits.target.copy()
        if rows is not None:
            rows(x, y)
        if table:
            frame = pd.DataFrame(x.reshape(len(x), -1), columns=[f"p{i}" for i in range(64)])
            frame["label"] = y
            frame.to_csv(ctx.tmp / "digits.csv", index=False)
            source = "path = 'digits.csv'"
        else:
            np.savez(ctx.tmp / "digits.npz", x=x, y=y)
            source = "path = 'digits.npz'"
        text = (f"[data]\ndataset = 'file'\n{source}\n{data}\n"
                f"[model]\nfactory = 'user_net:{model or 'good'}'\n"
                + (f"layers = {layers}\n" if layers else "")
                + (f"fix = {fix}\n" if fix else "") + "[training]\nepochs = 1\n")
        path = ctx.config(text)
        return ["config", "--check", path] if command == "check" else [
            command, path, "--out", ctx.path("out")]
    return argv


def _label(value: int) -> Callable[..., None]:
    def damage(x: object, y: object) -> None:
        y[7] = value  # type: ignore[index]
    return damage


def _nan(x: object, y: object) -> None:
    x[3, 0, 2, 2] = float("nan")  # type: ignore[index]


# ---- issue 26 (a bad --address, records a resume checks): helpers ---------------------------
def _closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_sweep(ctx: Ctx) -> Path:
    """A copy of the single-trial run directory whose manifest calls it a sweep's: the smallest
    run directory whose records and address `resume` checks."""
    run = ctx.run()
    with RunDir.open(run, write=True) as opened:
        opened.manifest["kind"] = "sweep"
        opened.record([])
    return run


def _address(command: str, address: str, *, client: bool = True) -> Callable[[Ctx], list[str]]:
    """`run` or `resume` with a bad --address (``{closed}``: a closed port); without
    ``client``, as if the Ray Client package were not installed."""
    def argv(ctx: Ctx) -> list[str]:
        text = address.format(closed=_closed_port())
        if not client:
            import ray._private.utils

            ctx.monkeypatch.setattr(ray._private.utils, "get_ray_client_dependency_error",
                                    lambda: "grpcio is not installed")
        if command == "run":
            return ["run", ctx.config(GOOD), "--out", ctx.path("out"), "--address", text]
        return ["resume", str(_as_sweep(ctx)), "--quiet", "--address", text]
    return argv


def _damaged_sweep(damage: Callable[[Ctx, Path], object]) -> Callable[[Ctx], list[str]]:
    """`resume` of a sweep's run directory after ``damage(ctx, run)``."""
    def argv(ctx: Ctx) -> list[str]:
        run = _as_sweep(ctx)
        damage(ctx, run)
        return ["resume", str(run), "--quiet"]
    return argv


def _truncated_results(*, rerecorded: bool) -> Callable[[Ctx, Path], None]:
    def damage(ctx: Ctx, run: Path) -> None:
        path = run / layout.RESULTS
        path.write_bytes(path.read_bytes()[:100])
        if rerecorded:
            ctx.rerecord(run, [layout.RESULTS])
    return damage


def _finished_in_optuna(ctx: Ctx, run: Path) -> None:
    """An Optuna storage that counts trial-007 as finished, a trial that left no records."""
    import optuna

    from dpsweep.core.layout import OPTUNA_DB
    from dpsweep.orchestrator.sweep.studies import ID_ATTR

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="dpsgd@eps3", storage=f"sqlite:///{run / OPTUNA_DB}")
    trial = study.ask()
    trial.set_user_attr(ID_ATTR, "trial-007")
    study.tell(trial, 0.5)
# ---- (end of issue 26's address and records helpers) ------------------------------------------


def _out(command: str, where: Callable[[Ctx], str]) -> Callable[[Ctx], list[str]]:
    """A valid config (or run directory) written to a bad --out."""
    def argv(ctx: Ctx) -> list[str]:
        out = where(ctx)
        if command == "export":
            return ["export", str(ctx.run()), "--trial", TRIAL, "--out", out]
        return [command, ctx.config(GOOD), "--out", out]
    return argv


def _under_file(ctx: Ctx) -> str:
    (ctx.tmp / "file").write_text("a regular file")
    return ctx.path("file/out")


def _dangling(ctx: Ctx) -> str:
    os.symlink(ctx.tmp / "nowhere", ctx.tmp / "link")
    return ctx.path("link")


def _non_empty(ctx: Ctx) -> str:
    (ctx.tmp / "full").mkdir()
    (ctx.tmp / "full" / "keep.txt").write_text("precious")
    return ctx.path("full")


def _proc(ctx: Ctx) -> str:
    return "/proc/dpsweep-bad-input/out"


# ---- issue 26 (config values, --out forms, the baseline, budget flags): helpers -------------
#: A TOML integer beyond float range: is_real() would raise OverflowError on it.
HUGE_INT = "1" + "0" * 400


def _baseline(command: str) -> Callable[[Ctx], list[str]]:
    """`export`, `audit` or `pick --series` of the non-private baseline, recorded as a sweep
    records it."""
    def argv(ctx: Ctx) -> list[str]:
        from dpsweep.orchestrator.sweep.jobs import BASELINE_ID, baseline_row

        run = ctx.run()
        rows = store.read_results(run).to_dict("records")
        rows.append(baseline_row({"val_accuracy": 0.9, "val_loss": 0.3, "test_accuracy": 0.9,
                                  "test_loss": 0.3, "train_seconds": 1.0}, num_classes=10))
        store.write_results(run, rows)
        ctx.rerecord(run, [layout.RESULTS])
        if command == "pick":
            return ["pick", str(run), "--series", BASELINE_ID]
        extra = ["--out", ctx.path("release")] if command == "export" else []
        return [command, str(run), "--trial", BASELINE_ID, *extra]
    return argv


def _budget(*flags: str) -> Callable[[Ctx], list[str]]:
    """`dpsweep budget` with defaults for the flags not given."""
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    full = {"--epsilon": "3", "--delta": "1e-5", "--sample-rate": "0.01", "--steps": "100",
            **given}
    return _simple("budget", *(x for kv in full.items() for x in kv))


def _unknown_run(command: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        return _on_run(command, ctx, ctx.tmp / "no-such-run")
    return argv


def _on_run(command: str, ctx: Ctx, run: Path) -> list[str]:
    extra = {"export": ["--trial", TRIAL, "--out", ctx.path("release")],
             "audit": ["--trial", TRIAL], "resume": ["--quiet"],
             "reaudit": ["--quiet"]}.get(command, [])
    return [command, str(run), *extra]


def _no_manifest(command: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        run = ctx.run()
        (run / MANIFEST).unlink()
        return _on_run(command, ctx, run)
    return argv


def _edited_results(command: str) -> Callable[[Ctx], list[str]]:
    """results.parquet rewritten (a claimed epsilon lowered) after the run was written."""
    def argv(ctx: Ctx) -> list[str]:
        run = ctx.audited() if command == "pick" else ctx.run()
        frame = pd.read_parquet(run / layout.RESULTS)
        frame.loc[0, "epsilon_upper"] = 0.01
        frame.to_parquet(run / layout.RESULTS)
        return _on_run(command, ctx, run)
    return argv


def _edited_privacy(command: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        run = ctx.audited() if command == "pick" else ctx.run()
        record = json.loads((run / PRIVACY).read_text())
        record["epsilon_upper"] = 0.01
        (run / PRIVACY).write_text(json.dumps(record))
        return _on_run(command, ctx, run)
    return argv


def _crafted_checkpoint(command: str, *, rerecorded: bool) -> Callable[[Ctx], list[str]]:
    """trials/<id>/checkpoint/state.pt replaced by a pickle that runs code when loaded."""
    def argv(ctx: Ctx) -> list[str]:
        run = ctx.audited() if command == "pick" else ctx.run()
        ctx.evil_pickle(run, STATE)
        if rerecorded:
            ctx.rerecord(run, [STATE])
        if command == "pick":
            return ["pick", str(run), "--export", ctx.path("release")]
        return _on_run(command, ctx, run)
    return argv


def _corrupt_checkpoint(*, rerecorded: bool) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        run = ctx.run()
        state = run / STATE
        state.write_bytes(state.read_bytes()[:1000])
        if rerecorded:
            ctx.rerecord(run, [STATE])
        return _on_run("export", ctx, run)
    return argv


def _tune_pickle_resume(ctx: Ctx) -> list[str]:
    """Resuming a single-trial run directory must be refused, whatever lies in tune/."""
    run = ctx.run()
    ctx.evil_pickle(run, "tune/attempt-1/experiment_state-2026-01-01_00-00-00.pkl")
    return ["resume", str(run), "--quiet"]


def _pick(*flags: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        return ["pick", str(ctx.audited()), *flags]
    return argv


def _export(which: str, *flags: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        return ["export", str(ctx.run(which)), "--out", ctx.path("release"), *flags]
    return argv


def _audit(*flags: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        return ["audit", str(ctx.run()), *flags]
    return argv


def _simple(*args: str) -> Callable[[Ctx], list[str]]:
    return lambda ctx: list(args)


HASH = "SHA-256 differs"
NO_MANIFEST = "a dpsweep run directory (with manifest.json)"
SPLIT = "train_size + validation_size + holdout_size + shadow_size"

CASES = [
    # ---- a user's model and data (refused before anything is written or Ray starts) -----------
    Case("user-model-batchnorm", _user("batchnorm", command="run"), "model.factory",
         "'user_net:batchnorm'", "set [model] fix = true to replace every BatchNorm with "
         "GroupNorm, or replace them yourself (GroupNorm or LayerNorm) (1 BatchNorm module "
         "('1'): "),
    Case("user-model-batchnorm-fix-not-a-bool", _user("batchnorm", fix="'yes'"), "model.fix",
         "'yes'", "true or false"),
    Case("user-model-every-parameter-frozen", _user("frozen", command="train"),
         "model.factory", "'user_net:frozen'", "leave at least one parameter trainable ("),
    Case("layer-freezing-with-one-trained-layer",
         _user("frozen_body", data="[sweep]\nmethods = ['dpsgd_lf']"), "method", "'dpsgd_lf'",
         "a model with at least 2 trained layers (dpsgd_lf: DP-SGD that freezes the first m_f "
         "layers from step t_f); this model has 1: choose another method"),
    Case("user-model-weights-file-the-workers-lack", _weights_beside_the_factory,
         "model.args.weights", "'backbone.pt'", "an absolute path every worker can read ("),
    Case("user-model-factory-raises", _user("raises"), "model.factory", "'user_net:raises'",
         "RuntimeError: no such width"),
    Case("user-model-not-a-module", _user("not_a_module"), "model.factory",
         "'user_net:not_a_module'", "returns a torch.nn.Module (it returned str)"),
    Case("user-model-missing-function", _user("absent"), "model.factory", "'user_net:absent'",
         "it has no 'absent'"),
    Case("user-model-layer-not-a-module", _user(layers="['body', 'tail']"), "model.layers",
         "['body', 'tail']", "module names of the model ('tail' is not one)"),
    Case("user-data-label-out-of-range", _user(data="num_classes = 10", rows=_label(12)),
         "data.num_classes", "10", "private row 7 holds label 12"),
    Case("user-data-negative-label", _user(rows=_label(-1), command="run"), "data.path",
         "digits.npz", "class labels >= 0; row 7 holds -1"),
    Case("user-data-nan-feature", _user(rows=_nan), "data.path", "nan", "finite"),
    Case("user-data-missing-column", _user(data="label_column = 'target'", table=True),
         "data.label_column", "'target'", "label"),
    Case("user-data-file-key-with-builtin-dataset", _cfg("[data]\npath = 'x.npz'\n"),
         "data.path", "x.npz", "unset unless data.dataset = 'file'"),
    Case("user-data-missing-file", _cfg("[data]\ndataset = 'file'\npath = 'nowhere.npz'\n"),
         "data.path", "nowhere.npz", "nothing is at that path"),
    # ---- issue 26: a bad --address and damaged records, refused before anything is written
    # ---- (run) or changed (resume: the lock's bookkeeping only) and before Ray starts ---------
    Case("run-address-not-an-address", _address("run", "not an address"), "--address",
         "'not an address'", "host:port"),
    Case("run-address-port-out-of-range", _address("run", "127.0.0.1:1"), "--address",
         "'127.0.0.1:1'", "a port in 1024..65535"),
    Case("run-address-closed-port", _address("run", "127.0.0.1:{closed}"), "--address",
         "'127.0.0.1:", "connecting failed"),
    Case("run-address-ray-client-not-installed",
         _address("run", "ray://127.0.0.1:{closed}", client=False), "--address",
         "'ray://127.0.0.1:", "pip install 'ray[client]'"),
    Case("resume-address-not-an-address", _address("resume", "not an address"), "--address",
         "'not an address'", "host:port"),
    Case("resume-address-closed-port", _address("resume", "127.0.0.1:{closed}"), "--address",
         "'127.0.0.1:", "connecting failed"),
    Case("resume-truncated-results", _damaged_sweep(_truncated_results(rerecorded=False)),
         "RUN_DIR", "'results.parquet'", "SHA-256 differs"),
    Case("resume-truncated-results-rerecorded",
         _damaged_sweep(_truncated_results(rerecorded=True)), "results", "results.parquet",
         "a readable Parquet file"),
    Case("resume-deleted-trial-directory",
         _damaged_sweep(lambda ctx, run: shutil.rmtree(run / "trials" / TRIAL)), "RUN_DIR",
         f"'trials/{TRIAL}'", "the directory is gone; restore it from a copy"),
    Case("resume-deleted-privacy-record",
         _damaged_sweep(lambda ctx, run: (run / PRIVACY).unlink()), "RUN_DIR", PRIVACY,
         "now missing; restore it from a copy"),
    Case("resume-finished-trial-without-records", _damaged_sweep(_finished_in_optuna),
         "RUN_DIR", "trials/trial-007/result.json", "finished according to optuna.db"),
    # ---- (end of issue 26's address and records cases) --------------------------------------
    # ---- config: sections, keys, types --------------------------------------------------------
    # ---- issue 26: nested values, huge integers, what the accountant can certify, ranges a
    # ---- fixed value would silently override, --out forms, the baseline, budget flags --------
    Case("budget-epsilons-nested-list", _cfg("[budget]\nepsilons = [[3]]\n"), "budget.epsilons",
         "[[3]]", "distinct numbers in (0, 100]"),
    Case("budget-epsilons-table-entry", _cfg("[budget]\nepsilons = [{a = 1}]\n", "run"),
         "budget.epsilons", "[{'a': 1}]", "distinct numbers in (0, 100]"),
    Case("budget-epsilons-nan-string", _cfg("[budget]\nepsilons = ['nan']\n"),
         "budget.epsilons", "['nan']", "distinct numbers"),
    Case("data-feature-columns-nested", _cfg("[data]\nfeature_columns = [['a']]\n"),
         "data.feature_columns", "[['a']]", "a list of column names"),
    Case("data-mean-table-entry", _cfg("[data]\nmean = [{a = 1}]\n"), "data.mean",
         "[{'a': 1}]", "a list of numbers"),
    Case("sweep-methods-nested-list", _cfg("[sweep]\nmethods = [['dpsgd']]\n", "run"),
         "sweep.methods", "[['dpsgd']]", "a list of 'method' or 'method:mode' strings"),
    Case("sweep-methods-empty-mode", _cfg("[sweep]\nmethods = ['dpsgd:']\n"), "sweep.methods",
         "'dpsgd:'", "'dpsgd' (its default mode)"),
    Case("epsilon-integer-beyond-float", _cfg(f"[privacy]\nepsilon = {HUGE_INT}\n"),
         "privacy.epsilon", "an integer of 1329 bits", "a 64-bit integer"),
    Case("split-seed-beyond-64-bits", _cfg("[data]\nsplit_seed = 18446744073709551617\n",
                                           "train"),
         "data.split_seed", "18446744073709551617", "a 64-bit integer"),
    Case("sweep-seed-beyond-optuna", _cfg("[sweep]\nseed = 4294967296\n", "run"), "sweep.seed",
         "4294967296", "an integer in [0, 2147483647]"),
    Case("model-args-date", _cfg("[model]\nargs = {when = 1979-05-27}\n"), "model.args.when",
         "1979-05-27", "no dpsweep key takes a date"),
    Case("method-param-integer-beyond-64-bits",
         _cfg("[method_params.dpsgd]\nclip_norm = 100000000000000000000\n"),
         "method_params.dpsgd.clip_norm", "100000000000000000000", "a 64-bit integer"),
    Case("search-bound-integer-beyond-64-bits",
         _cfg("[sweep]\nmethods = ['dpsgd']\n[search.dpsgd]\nclip_norm = {low = 1, high = "
              "100000000000000000000}\n"), "search.dpsgd.clip_norm.high",
         "100000000000000000000", "a 64-bit integer"),
    Case("search-choices-nested-list",
         _cfg("[sweep]\nmethods = ['dp_adamilg']\n[search.dp_adamilg]\nk = {choices = "
              "[[0.1]]}\n"), "search.dp_adamilg.k.choices", "[0.1]", "a finite number"),
    Case("search-choices-duplicate",
         _cfg("[sweep]\nmethods = ['dp_adamilg']\n[search.dp_adamilg]\nk = {choices = "
              "[0.1, 0.1]}\n", "run"), "search.dp_adamilg.k.choices", "[0.1, 0.1]",
         "distinct numbers"),
    Case("search-range-with-a-fixed-value-outside-it",
         _cfg("[sweep]\nmethods = ['dpsgd']\n[method_params]\nclip_norm = 3.0\n"
              "[search.dpsgd]\nclip_norm = {low = 0.2, high = 2.0}\n", "run"),
         "search.dpsgd.clip_norm", "{'low': 0.2, 'high': 2.0}",
         "no range while method_params.clip_norm = 3.0 fixes clip_norm"),
    Case("search-step-with-a-fixed-lr",
         _cfg("[sweep]\nmethods = ['dpsgd']\n[method_params.dpsgd]\nlr = 0.5\n"
              "[search.dpsgd]\nlr_x_clip = {low = 0.5, high = 1.0}\n"),
         "search.dpsgd.lr_x_clip", "{'low': 0.5, 'high': 1.0}",
         "no range while method_params.dpsgd.lr = 0.5 fixes lr"),
    Case("search-range-for-a-mode-not-swept",
         _cfg("[sweep]\nmethods = ['lm_dpsgd:public']\n[search.lm_dpsgd]\n"
              "lagged_beta = {low = 0.1, high = 0.9}\n"), "search.lm_dpsgd.lagged_beta",
         "{'low': 0.1, 'high': 0.9}", "read only in mode lagged"),
    Case("validation-of-one-example", _cfg("[data]\nvalidation_size = 1\n"),
         "data.validation_size", "1", "at least 35 examples for 10 classes"),
    Case("run-validation-of-one-example", _cfg("[data]\nvalidation_size = 1\n", "run"),
         "data.validation_size", "1", "at least 35 examples for 10 classes"),
    Case("epsilon-below-what-the-accountant-certifies", _cfg("[privacy]\nepsilon = 1e-9\n"),
         "privacy.epsilon", "1e-09", "never certifies less at this delta"),
    Case("run-epsilon-below-what-the-accountant-certifies",
         _cfg("[privacy]\nepsilon = 1e-9\n", "run"), "privacy.epsilon", "1e-09",
         "never certifies less at this delta"),
    Case("run-delta-subnormal", _cfg("[privacy]\ndelta = 5e-324\n", "run"), "privacy.delta",
         "5e-324", "a number >= 1.6e-13 for 160 training steps"),
    Case("budget-epsilons-below-what-the-accountant-certifies",
         _cfg("[budget]\nepsilons = [0.01, 3.0]\n"), "budget.epsilons", "[0.01, 3.0]",
         "0.01 is below what the accountant's RDP bound certifies"),
    Case("run-out-empty", _out("run", lambda ctx: ""), "--out", "''", "a non-empty path"),
    Case("train-out-with-a-newline", _out("train", lambda ctx: ctx.path("a\nb")), "--out",
         "a\\nb", "without line breaks"),
    Case("train-out-component-too-long", _out("train", lambda ctx: "x" * 300), "--out",
         "xxxxxxxx", "at most 255 bytes"),
    Case("run-out-path-too-long", _out("run", lambda ctx: "/".join(["y" * 200] * 25)), "--out",
         "yyyyyyyy", "shorter than 4096 bytes"),
    Case("export-out-component-too-long", _out("export", lambda ctx: "z" * 300), "--out",
         "zzzzzzzz", "at most 255 bytes"),
    Case("pick-export-empty", lambda ctx: ["pick", str(ctx.audited()), "--export", ""],
         "--export", "''", "a non-empty path"),
    Case("resume-run-dir-component-too-long", _simple("resume", "r" * 300), "RUN_DIR",
         "rrrrrrrr", "at most 255 bytes"),
    Case("check-config-name-too-long", _simple("config", "--check", "c" * 300 + ".toml"),
         "CONFIG", "cccccccc", "at most 255 bytes"),
    Case("data-dir-component-too-long", _cfg(f"[data]\ndata_dir = '{'d' * 300}'\n"),
         "data.data_dir", "dddddddd", "at most 255 bytes"),
    Case("export-the-nonprivate-baseline", _baseline("export"), "--trial", "'nonprivate'",
         "the non-private baseline (no clipping, no noise), which has no DP guarantee"),
    Case("audit-the-nonprivate-baseline", _baseline("audit"), "--trial", "'nonprivate'",
         "the non-private baseline (no clipping, no noise), which claims no epsilon"),
    Case("pick-the-nonprivate-baseline-series", _baseline("pick"), "--series", "'nonprivate'",
         "'nonprivate' is the non-private baseline"),
    Case("budget-sample-rate-too-small", _budget("--sample-rate", "1e-300"), "--sample-rate",
         "1e-300", "a number in [1e-09, 1]"),
    Case("budget-epsilon-below-what-the-accountant-certifies", _budget("--epsilon", "1e-9"),
         "--epsilon (privacy.epsilon)", "1e-09", "never certifies less"),
    Case("budget-delta-subnormal", _budget("--delta", "5e-324"), "--delta (privacy.delta)",
         "5e-324", "a number >= 1e-13 for 100 training steps"),
    # ---- (end of issue 26's cases) ----------------------------------------------------------
    Case("unknown-section", _cfg("[trainig]\nepochs = 1\n"), "trainig", "'[table]'",
         "unknown section"),
    Case("unknown-key", _cfg("[training]\nlrr = 0.1\n"), "training.lrr", "0.1", "unknown key"),
    Case("key-moved-to-method-params", _cfg("[training]\nlr = 0.1\n", "train"), "training.lr",
         "0.1", "unknown key"),
    Case("section-not-a-table", _cfg("privacy = 3\n"), "privacy", "3", "a table"),
    Case("wrong-type-string-for-float", _cfg("[privacy]\nepsilon = 'three'\n"),
         "privacy.epsilon", "'three'", "a finite number in (0, 100]"),
    Case("bool-for-int", _cfg("[training]\nepochs = true\n", "train"), "training.epochs",
         "True", "an integer in [1, 10000]"),
    Case("int-for-bool", _cfg("[training]\nreproducible = 1\n"), "training.reproducible", "1",
         "true or false"),
    Case("float-for-int", _cfg("[training]\nbatch_size = 64.5\n"), "training.batch_size",
         "64.5", "an integer >= 1"),
    Case("out-of-range-epochs", _cfg("[training]\nepochs = 0\n", "run"), "training.epochs",
         "0", "[1, 10000]"),
    Case("negative-size", _cfg("[data]\ntrain_size = -5\n"), "data.train_size", "-5", ">= 0"),
    Case("validation-too-small-for-layer-probes",
         _cfg("[data]\nvalidation_size = 40\n[training]\nepochs = 1\n", "run"),
         "data.validation_size", "40", "audit.layer_probes = false"),
    Case("nan-epsilon", _cfg("[privacy]\nepsilon = nan\n"), "privacy.epsilon", "nan",
         "a finite number"),
    Case("inf-epsilon", _cfg("[privacy]\nepsilon = inf\n", "train"), "privacy.epsilon", "inf",
         "a finite number"),
    Case("huge-epsilon", _cfg("[privacy]\nepsilon = 1e6\n"), "privacy.epsilon", "1000000.0",
         "(0, 100]"),
    Case("delta-above-one-over-n", _cfg("[privacy]\ndelta = 0.002\n"), "privacy.delta",
         "0.002", "< 1/train_size = 0.002"),
    Case("delta-above-one-over-custom-n",
         _cfg("[data]\ntrain_size = 100\n[privacy]\ndelta = 0.01\n", "train"), "privacy.delta",
         "0.01", "< 1/train_size = 0.01"),
    Case("delta-not-below-one", _cfg("[privacy]\ndelta = 1.0\n"), "privacy.delta", "1.0",
         "(0, 1)"),
    Case("split-larger-than-digits", _cfg("[data]\ntrain_size = 1500\n", "train"), "data.sizes",
         f"{SPLIT} + test_size = 2797", "<= 1797"),
    Case("split-larger-than-fmnist-train",
         _cfg("[data]\ndataset = 'fashion-mnist'\nshadow_size = 40000\n"), "data.sizes",
         f"{SPLIT} = 85000", "<= 60000"),
    Case("test-larger-than-official", _cfg("[data]\ndataset = 'mnist'\ntest_size = 10001\n"),
         "data.test_size", "10001", "<= 10000"),
    Case("batch-larger-than-train", _cfg("[training]\nbatch_size = 501\n"),
         "training.batch_size", "501", "<= train_size = 500"),
    Case("shadow-pool-too-small-for-lm-stage1",
         _cfg("[data]\nshadow_size = 5\n[training]\nmethod = 'lm_dpsgd'\n"),
         "data.shadow_size", "5", "20"),
    Case("train-shadow-pool-too-small-for-lm-stage1",
         _cfg("[data]\nshadow_size = 5\n[training]\nmethod = 'lm_dpsgd'\n", "train"),
         "data.shadow_size", "5", "20"),
    Case("unknown-training-method", _cfg("[training]\nmethod = 'sgd'\n"), "training.method",
         "'sgd'", "'dpsgd'"),
    Case("unknown-preset", _cfg("[training]\npreset = 'paper'\n"), "training.preset",
         "'paper'", "a preset of dpsgd: none"),
    Case("unknown-model", _cfg("[model]\nname = 'resnet50'\n"), "model.name", "'resnet50'",
         "'resnet20_gn'"),
    Case("cuda-on-a-machine-without-one", _no_gpu("[resources]\ndevice = 'cuda'\n"),
         "resources.device", "'cuda'", "'cpu' or 'auto': this machine has no GPU"),
    Case("train-cuda-on-a-machine-without-one",
         _no_gpu("[resources]\ndevice = 'cuda'\ngpus_per_trial = 1\n", "train"),
         "resources.device", "'cuda'", "'cpu' or 'auto': this machine has no GPU"),
    Case("gpus-on-a-machine-without-one", _no_gpu("[resources]\ngpus_per_trial = 1\n"),
         "resources.gpus_per_trial", "1.0", "0: this machine has no GPU"),
    Case("more-cpus-than-the-machine", _cfg("[resources]\ncpus_per_trial = 1024\n", "run"),
         "resources.cpus_per_trial", "1024", "the CPUs of this machine"),
    Case("invalid-toml", _cfg("[data\n"), "CONFIG", "c.toml", "valid TOML"),
    Case("missing-config", _simple("config", "--check", "/nonexistent/dpsweep.toml"), "CONFIG",
         "'/nonexistent/dpsweep.toml'", "an existing TOML file"),
    # ---- config: methods, modes, method parameters, search ranges, budgets ---------------------
    Case("sweep-unknown-method", _cfg("[sweep]\nmethods = ['x']\n"), "sweep.methods", "'x'",
         "a registered method"),
    Case("sweep-unknown-mode", _cfg("[sweep]\nmethods = ['lm_dpsgd:nope']\n", "run"),
         "sweep.methods", "'lm_dpsgd:nope'", "a mode of lm_dpsgd: public, lagged, faithful"),
    Case("sweep-duplicates", _cfg("[sweep]\nmethods = ['dpsgd', 'dpsgd:standard']\n"),
         "sweep.methods", "['dpsgd', 'dpsgd:standard']", "distinct"),
    Case("sweep-methods-not-a-list", _cfg("[sweep]\nmethods = 'dpsgd'\n"), "sweep.methods",
         "'dpsgd'", "a list"),
    Case("method-param-nobody-declares", _cfg("[method_params]\nlearning_rate = 0.1\n",
                                              "train"),
         "method_params.learning_rate", "0.1", "a hyperparameter declared by"),
    Case("method-param-bad-value", _cfg("[method_params]\nclip_norm = 0\n"),
         "method_params.clip_norm", "0", "a finite number in (0, 10000]"),
    Case("method-table-of-unknown-method", _cfg("[method_params.sgd]\nlr = 0.1\n"),
         "method_params.sgd", "'[table]'", "a table named after a method"),
    Case("mode-specific-key-for-another-mode",
         _cfg("[sweep]\nmethods = ['lm_dpsgd:public']\n[method_params]\nlagged_beta = 0.5\n"),
         "method_params.lagged_beta", "0.5", "used only in mode lagged"),
    Case("faithful-only-key-in-public-mode",
         _cfg("[sweep]\nmethods = ['dp_adamilg']\n[method_params.dp_adamilg]\nalpha = 2.0\n"),
         "method_params.alpha", "2.0", "used only in mode faithful"),
    Case("freezing-every-layer-of-the-model",
         _cfg("[sweep]\nmethods = ['dpsgd_lf']\n[method_params.dpsgd_lf]\nm_f = 4\n"),
         "method_params.m_f", "4", "[0, 3]"),
    Case("train-freezing-every-layer-of-the-model",
         _cfg("[training]\nmethod = 'dpsgd_lf'\n[method_params.dpsgd_lf]\nm_f = 4\n", "train"),
         "method_params.m_f", "4", "[0, 3]"),
    Case("search-range-outside-declaration",
         _cfg("[sweep]\nmethods = ['dpsgd']\n[search.dpsgd]\nclip_norm = {low = 0.0, high = "
              "1.0}\n"), ("search.dpsgd.clip_norm.low", "search.dpsgd.clip_norm.clip_norm"),
         "0.0", "(0, 10000]"),
    Case("search-low-not-below-high",
         _cfg("[sweep]\nmethods = ['dpsgd']\n[search.dpsgd]\nclip_norm = {low = 2.0, high = "
              "1.0}\n"), "search.dpsgd.clip_norm.high", "1.0", "> low = 2.0"),
    Case("search-undeclared-parameter",
         _cfg("[sweep]\nmethods = ['dpsgd']\n[search.dpsgd]\nkappa = {low = 0.1, high = 1.0}\n"),
         "search.dpsgd.kappa", "{'low': 0.1, 'high': 1.0}", "declared by dpsgd"),
    Case("search-for-a-method-not-swept",
         _cfg("[sweep]\nmethods = ['dpsgd']\n[search.ww_dpsgd]\nK = {choices = [10]}\n"),
         "search.ww_dpsgd", "'[table]'", "a swept method: ['dpsgd']"),
    Case("budget-epsilons-duplicate", _cfg("[budget]\nepsilons = [1, 2, 1]\n"),
         "budget.epsilons", "[1, 2, 1]", "distinct numbers in (0, 100]"),
    Case("budget-epsilons-out-of-range", _cfg("[budget]\nepsilons = [0.5, 1000]\n", "run"),
         "budget.epsilons", "[0.5, 1000]", "(0, 100]"),
    Case("budget-epsilons-not-a-list", _cfg("[budget]\nepsilons = 3.0\n"), "budget.epsilons",
         "3.0", "a list"),
    # ---- config: private tuning admits nothing adaptive (refused before anything is written) ---
    Case("private-tuning-with-reruns",
         _cfg("[sweep]\ntuning = 'private'\nseeds = 2\n[audit]\nin_trial = false\n", "run"),
         "sweep.seeds", "2", "0 with sweep.tuning = 'private'"),
    Case("private-tuning-with-reruns-and-in-trial-audit",
         _cfg("[sweep]\ntuning = 'private'\nseeds = 2\n[audit]\nin_trial = true\n"),
         "sweep.seeds", "2", "0 with sweep.tuning = 'private'"),
    Case("private-tuning-with-in-trial-audit", _cfg("[sweep]\ntuning = 'private'\n", "run"),
         "audit.in_trial", "True", "false (or audit.enabled = false) with sweep.tuning = "
         "'private'"),
    Case("private-tuning-score-noise-too-small",
         _cfg("[sweep]\nmethods = ['dpsgd']\ntuning = 'private'\nscore_noise = 0.5\n"
              "[audit]\nenabled = false\n",
              "run"), "sweep.score_noise", "0.5", "more noise"),
    # ---- config: data that is not on this machine --------------------------------------------
    Case("check-fmnist-data-dir-empty", _missing_data("check"), "data.data_dir", "empty",
         "Fashion-MNIST IDX files"),
    Case("train-fmnist-data-dir-empty", _missing_data("train"), "data.data_dir", "empty",
         "Fashion-MNIST IDX files"),
    Case("check-mnist-not-downloaded", _mnist_not_downloaded, "data.data_dir", "cache",
         "would have to be downloaded"),
    Case("config-method-unknown", _simple("config", "--method", "sgd"), "method", "'sgd'",
         "'dpsgd'"),
    # ---- --out ---------------------------------------------------------------------------------
    Case("train-out-under-a-file", _out("train", _under_file), "--out", "file/out",
         "a path under a directory"),
    Case("train-out-in-proc", _out("train", _proc), "--out", "/proc/dpsweep-bad-input/out",
         "not /proc"),
    Case("train-out-dangling-symlink", _out("train", _dangling), "--out", "link",
         "not a dangling symbolic link"),
    Case("train-out-not-empty", _out("train", _non_empty), "--out", "full",
         "a new or empty directory"),
    Case("run-out-not-empty", _out("run", _non_empty), "--out", "full",
         "a new or empty directory"),
    Case("run-out-under-a-file", _out("run", _under_file), "--out", "file/out",
         "a path under a directory"),
    Case("export-out-not-empty", _out("export", _non_empty), "--out", "full",
         "a new or empty directory"),
    Case("export-out-in-proc", _out("export", _proc), "--out", "/proc/dpsweep-bad-input",
         "not /proc"),
    # ---- RUN_DIR -------------------------------------------------------------------------------
    *(Case(f"{c}-unknown-run-dir", _unknown_run(c), "RUN_DIR", "no-such-run",
           "run directory") for c in ("report", "pick", "export", "resume", "reaudit",
                                      "audit")),
    *(Case(f"{c}-without-manifest", _no_manifest(c), "RUN_DIR", "/run'", NO_MANIFEST)
      for c in ("report", "pick", "export", "resume", "reaudit", "audit")),
    *(Case(f"{c}-edited-results", _edited_results(c), "RUN_DIR", "'results.parquet'", HASH)
      for c in ("report", "pick", "export", "audit")),
    *(Case(f"{c}-edited-privacy-record", _edited_privacy(c), "RUN_DIR", PRIVACY, HASH)
      for c in ("pick", "export")),
    Case("export-crafted-checkpoint-pickle", _crafted_checkpoint("export", rerecorded=False),
         "RUN_DIR", STATE, HASH),
    Case("export-crafted-checkpoint-pickle-rerecorded",
         _crafted_checkpoint("export", rerecorded=True), "checkpoint", "state.pt",
         "a readable dpsweep checkpoint"),
    Case("pick-export-crafted-checkpoint-pickle-rerecorded",
         _crafted_checkpoint("pick", rerecorded=True), "checkpoint", "state.pt",
         "a readable dpsweep checkpoint"),
    Case("export-corrupt-checkpoint", _corrupt_checkpoint(rerecorded=False), "RUN_DIR", STATE,
         HASH),
    Case("export-corrupt-checkpoint-rerecorded", _corrupt_checkpoint(rerecorded=True),
         "checkpoint", "state.pt", "a readable dpsweep checkpoint"),
    Case("resume-single-trial-run-with-tune-pickle", _tune_pickle_resume, "RUN_DIR", "run",
         "sweep"),
    # ---- pick, export, audit arguments ---------------------------------------------------------
    Case("pick-max-peak-mia-above-one", _pick("--max-peak-mia", "1.5"), "--max-peak-mia", "1.5",
         "a number in [0, 1]"),
    Case("pick-max-peak-mia-nan", _pick("--max-peak-mia", "nan"), "--max-peak-mia", "nan",
         "a number in [0, 1]"),
    Case("pick-min-val-acc-negative", _pick("--min-val-acc", "-0.1"), "--min-val-acc", "-0.1",
         "a number in [0, 1]"),
    Case("export-replayable-trial", _export("replayable", "--trial", TRIAL), "randomness",
         "'reproducible'", "--allow-replayable"),
    Case("export-unknown-trial", _export("secret", "--trial", "trial-999"), "--trial",
         "'trial-999'", "a trial of this run: ['trial-000']"),
    Case("export-trial-id-with-path", _export("secret", "--trial", "../trial-000"), "trial id",
         "'../trial-000'", "one path component"),
    Case("audit-zero-canaries", _audit("--trial", TRIAL, "--canaries", "0"), "--canaries", "0",
         "an integer >= 1"),
    Case("audit-unknown-trial", _audit("--trial", "trial-999"), "--trial", "'trial-999'",
         "a trial of this run"),
]


#: `dpsweep budget --epsilon 1e6` (the flag may also name its config key)
BUDGET_CASE = Case("budget-huge-epsilon", _simple(), ("--epsilon", "--epsilon (privacy.epsilon)"),
                   "1000000.0", "(0, 100]")


# ---- the checks --------------------------------------------------------------------------------
def snapshot(root: Path, *, ignore: tuple[str, ...] = ()) -> dict[str, object]:
    """Every entry under ``root``: files by size and SHA-256, links by target, directories."""
    entries: dict[str, object] = {}
    for top, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(top) / name
            rel = str(path.relative_to(root))
            if name in ignore:
                continue
            if path.is_symlink():
                entries[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                entries[rel] = "dir"
            else:
                entries[rel] = (path.stat().st_size,
                                hashlib.sha256(path.read_bytes()).hexdigest())
    return entries


def check_line(rc: object, out: str, err: str, case: Case) -> None:
    """Exit 2, one stderr line `dpsweep: error: FIELD = VALUE is not allowed: expected ...`."""
    assert "Traceback" not in out + err, err
    assert rc == 2, f"exit {rc!r}; stderr: {err!r}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {lines!r}"
    line = lines[0]
    assert line.startswith(PREFIX), line
    assert SEPARATOR in line, line
    named, allowed = line[len(PREFIX):].split(SEPARATOR, 1)
    assert any(named.startswith(f"{f} = ") for f in case.fields), (case.fields, line)
    assert case.value in named, (case.value, line)
    assert case.allowed in allowed, (case.allowed, line)


@contextlib.contextmanager
def interpreter_warnings() -> Iterator[None]:
    """Warnings as a user of the command sees them (pytest would only record them): Python's
    default filters, printed to stderr."""
    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: object = None, line: str | None = None) -> None:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.resetwarnings()
        for action, category in (("ignore", DeprecationWarning),
                                 ("ignore", PendingDeprecationWarning),
                                 ("ignore", ImportWarning), ("ignore", ResourceWarning)):
            warnings.simplefilter(action, category)
        warnings.showwarning = show
        yield


class _Reached(Exception):
    """Raised by the stubs of the expensive stages: validation let the input through."""


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Input that wrongly passes validation must fail fast, not start Ray or train canaries."""
    import importlib

    def reached(*_: object, **__: object) -> None:
        raise _Reached("validation passed: the command went on to its expensive stage")

    for module, names in (("dpsweep.orchestrator.sweep.driver", ["_drive"]),
                          ("dpsweep.orchestrator.sweep.reaudit", ["_reaudit"]),
                          ("dpsweep.orchestrator.audit.canary",
                           ["black_box_run", "white_box_run"])):
        loaded = importlib.import_module(module)
        for name in names:
            monkeypatch.setattr(loaded, name, reached)
    return monkeypatch


def test_the_table_is_large_and_its_ids_unique() -> None:
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, runs: Runs, tmp_path: Path, guarded: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:
    ctx = Ctx(tmp=tmp_path, runs=runs, monkeypatch=guarded)
    argv = case.argv(ctx)
    locking = argv[0] in ("resume", "reaudit", "audit")  # may refresh the lock's bookkeeping
    ignore = (LOCK, LOCK_INFO) if locking else ()
    before = snapshot(tmp_path, ignore=ignore)
    capsys.readouterr()
    with interpreter_warnings():
        try:
            rc: object = main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code
    out, err = capsys.readouterr()
    check_line(rc, out, err, case)
    assert not ctx.marker.exists(), "a crafted pickle was executed"
    assert snapshot(tmp_path, ignore=ignore) == before, "bad input must write nothing"


def test_budget_with_a_huge_epsilon_is_refused_before_any_accounting(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """epsilon = 1e6 would make the accountant discretise a huge range (minutes, >10 GB)."""
    import dpsweep.orchestrator.accounting.calibration
    def calibrate(**_: object) -> None:
        raise _Reached("calibrate was called for epsilon 1e6")

    monkeypatch.setattr(dpsweep.orchestrator.accounting.calibration, "calibrate", calibrate)
    start = time.perf_counter()
    rc = main(["budget", "--epsilon", "1e6", "--delta", "1e-5", "--sample-rate", "0.01",
               "--steps", "100"])
    assert time.perf_counter() - start < 5.0
    check_line(rc, *capsys.readouterr(), BUDGET_CASE)


def test_the_same_inputs_intact_are_accepted(runs: Runs, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The control: the run directories and config the table damages work when intact, so
    every refusal above is caused by the damage."""
    ctx = Ctx(tmp=tmp_path, runs=runs, monkeypatch=pytest.MonkeyPatch())
    assert main(["config", "--check", ctx.config(GOOD)]) == 0
    audited = ctx.audited()
    assert main(["pick", str(audited)]) == 0
    assert (audited / "pick.toml").is_file()
    assert main(["export", str(ctx.run(name="plain")), "--trial", TRIAL,
                 "--out", ctx.path("release")]) == 0
    assert main(["export", str(ctx.run("replayable", name="seeded")), "--trial", TRIAL,
                 "--out", ctx.path("seeded-release"), "--allow-replayable"]) == 0
    assert main(["report", str(ctx.run(name="reported"))]) == 0
    assert "error" not in capsys.readouterr().err


def test_state_pickles_in_a_run_directory_are_never_loaded(runs: Runs, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """Tune's experiment state is never read: report and export work around it, unharmed."""
    ctx = Ctx(tmp=tmp_path, runs=runs, monkeypatch=pytest.MonkeyPatch())
    run = ctx.run()
    ctx.evil_pickle(run, "tune/attempt-1/experiment_state-2026-01-01_00-00-00.pkl")
    ctx.evil_pickle(run, "tune/attempt-1/trainable_0001/checkpoint_000000/state.pkl")
    assert main(["export", str(run), "--trial", TRIAL, "--out", ctx.path("release")]) == 0
    assert main(["report", str(run)]) == 0
    capsys.readouterr()
    assert not ctx.marker.exists()


# ---- end to end: the installed script in a subprocess ------------------------------------------
def _subprocess(args: list[str], *, cwd: Path, memory_gib: int = 4,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The console script, with this tree's code, an address-space cap and a time limit."""
    def limits() -> None:
        cap = memory_gib << 30
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    exe = [str(DPSWEEP)] if DPSWEEP.exists() else [sys.executable, "-m", "dpsweep.orchestrator.cli"]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([*exe, *args], capture_output=True, text=True, cwd=cwd, env=full_env,
                          timeout=240, preexec_fn=limits)


END_TO_END = ["unknown-key", "train-out-in-proc", "export-crafted-checkpoint-pickle-rerecorded",
              "resume-unknown-run-dir", "check-fmnist-data-dir-empty"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in END_TO_END],
                         ids=[c.id for c in CASES if c.id in END_TO_END])
def test_bad_input_end_to_end(case: Case, runs: Runs, tmp_path: Path) -> None:
    ctx = Ctx(tmp=tmp_path / "case", runs=runs, monkeypatch=pytest.MonkeyPatch())
    ctx.tmp.mkdir()
    argv = case.argv(ctx)
    before = snapshot(ctx.tmp)
    r = _subprocess(argv, cwd=tmp_path)
    check_line(r.returncode, r.stdout, r.stderr, case)
    assert not ctx.marker.exists()
    assert snapshot(ctx.tmp) == before
    assert [p.name for p in tmp_path.iterdir()] == ["case"]  # nothing in the working directory


def test_budget_huge_epsilon_end_to_end(tmp_path: Path) -> None:
    """Within a 4 GiB address space the command must still answer with exit 2 (an
    accountant run for epsilon 1e6 would exhaust it, and take minutes)."""
    r = _subprocess(["budget", "--epsilon", "1e6", "--delta", "1e-5", "--sample-rate", "0.01",
                     "--steps", "100"], cwd=tmp_path,
                    env={"DPSWEEP_CACHE_DIR": str(tmp_path / "cache")})
    check_line(r.returncode, r.stdout, r.stderr, BUDGET_CASE)
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_snapshot_sees_every_kind_of_write(tmp_path: Path) -> None:
    """The 'nothing written' check itself: new files, edits, new directories and links."""
    (tmp_path / "a").write_text("x")
    before = snapshot(tmp_path)
    for change in (lambda: (tmp_path / "a").write_text("y"),
                   lambda: (tmp_path / "b").mkdir(),
                   lambda: os.symlink(tmp_path / "zz", tmp_path / "c"),
                   lambda: (tmp_path / "b" / "d").write_text("")):
        change()
        after = snapshot(tmp_path)
        assert after != before
        before = after
