"""Every cache is a hint: any content of any cache file (wrong types, wrong shapes, deep
nesting, huge, binary, a FIFO, a device, a symlink, a directory, unreadable) is ignored, logged
once and rebuilt; it never fails, hangs or changes a trial. One case per kind, over the engine's
plans, the budget's calibrations and LM-DP-SGD's layer risks (the audit's reference models are
checked in ``tests/unit/trainables/test_audit_cache.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dpsweep.core import hints
from dpsweep.core.hints import MAX_JSON_BYTES, read_json_hint
from dpsweep.orchestrator.accounting import cache as budget_cache
from dpsweep.orchestrator.accounting import calibrate
from dpsweep.trainables.audit import layer_risk
from dpsweep.trainables.engine import plan as engine_plan
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.models.networks import build_model
from tests.contract.conformance import digits

#: No case may take longer than this (a FIFO read without O_NONBLOCK waits forever).
HANG_S = 20
#: A valid JSON entry nested this deep (the reviewer's case).
DEEP = 200_000
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _json(value: Any) -> Callable[[Path], None]:
    return lambda path: path.write_text(json.dumps(value))


def _deep(path: Path) -> None:
    path.write_text("[" * DEEP + "]" * DEEP)


def _huge(path: Path) -> None:
    with path.open("wb") as fh:
        fh.truncate(MAX_JSON_BYTES * 4)  # sparse: large to stat, cheap to make


def _binary(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 64)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _device(path: Path) -> None:
    if not IS_ROOT:
        pytest.skip("making a device node needs root")
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero: endless if read


def _symlink(path: Path) -> None:
    target = path.parent / "elsewhere.json"
    target.write_text("{}")
    path.symlink_to(target)


def _symlink_to_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.mkdir()


def _unreadable(path: Path) -> None:
    if IS_ROOT:
        pytest.skip("root reads a file whatever its mode")
    path.write_text("{}")
    path.chmod(0)


#: Kinds of bad cache content, each a function that puts it at a path.
KINDS: dict[str, Callable[[Path], None]] = {
    "wrong_types": _json({"version": "x", "modules": "choice", "key": 3, "value": [1]}),
    "wrong_shapes": _json({"version": 1, "modules": [{"choice": "ghost"}], "value": {}}),
    "list": _json([1, 2, 3]),
    "deep": _deep, "huge": _huge, "binary": _binary, "fifo": _fifo, "device": _device,
    "symlink": _symlink, "symlink_to_zero": _symlink_to_zero, "directory": _directory,
    "unreadable": _unreadable,
}


@contextlib.contextmanager
def no_hang() -> Iterator[None]:
    """Fail instead of waiting forever (SIGALRM interrupts a blocked read)."""
    def fail(signum: int, frame: Any) -> None:
        raise TimeoutError(f"a cache read hung for {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def plant(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()
    KINDS[kind](path)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_file_is_a_logged_miss(kind: str, tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "entry.json"
    plant(path, kind)
    hints._LOGGED.clear()
    with no_hang():
        value = read_json_hint(path)
    if kind in ("wrong_types", "wrong_shapes", "list"):
        assert value is not None  # well-formed JSON: the caller's validation must refuse it
        return
    assert value is None
    assert any(str(path) in r.getMessage() for r in caplog.records)
    with no_hang():  # once per file and reason
        read_json_hint(path)
    assert sum(str(path) in r.getMessage() for r in caplog.records) == 1


def _engine() -> tuple[GradEngine, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10)
    return GradEngine(model), torch.randn(8, 1, 8, 8), torch.arange(8) % 10


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_engine_plan_cache_is_rebuilt(kind: str, tmp_path: Path) -> None:
    """The reviewer's case among them: valid JSON whose ``choice`` is a string or a list
    failed every resumed trial with AttributeError, for good."""
    engine, x, y = _engine()
    live = [True] * engine.num_layers
    fresh = engine.measure_plan(x, y, live=live, cache=tmp_path)
    (path,) = tmp_path.glob(f"{engine_plan.PLAN_PREFIX}*.json")
    plant(path, kind)
    again, _, _ = _engine()
    with no_hang():
        timed = again.measure_plan(x, y, live=live, cache=tmp_path)
    assert [t.module for t in timed] == [t.module for t in fresh]
    assert all(t.source != "cache" for t in timed)
    if kind != "directory":  # a directory in its place cannot be replaced: measured each time
        assert json.loads(path.read_text())["modules"]  # rebuilt as a regular plan
        assert {t.source for t in _engine()[0].measure_plan(x, y, live=live,
                                                            cache=tmp_path)} == {"cache"}


@pytest.mark.parametrize("choice", ["ghost", ["ghost"], None, {"norm": ["ghost"]}])
def test_plan_entries_of_the_wrong_type_are_ignored(choice: Any, tmp_path: Path) -> None:
    engine, x, y = _engine()
    live = [True] * engine.num_layers
    engine.measure_plan(x, y, live=live, cache=tmp_path)
    (path,) = tmp_path.glob(f"{engine_plan.PLAN_PREFIX}*.json")
    data = json.loads(path.read_text())
    data["modules"][0]["choice"] = choice
    path.write_text(json.dumps(data))
    timed = _engine()[0].measure_plan(x, y, live=live, cache=tmp_path)
    assert all(t.source != "cache" for t in timed)


#: A question that calibrates in a fraction of a second.
QUESTION = {"target_epsilon": 2.0, "delta": 1e-5, "sample_rate": 0.02, "steps": 250}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    cache = tmp_path_factory.mktemp("budget")
    return cache, calibrate(**QUESTION, cache_dir=cache)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_calibration_cache_is_rebuilt(kind: str, calibrated: tuple[Path, Any],
                                          tmp_path: Path) -> None:
    cache, first = calibrated
    (entry,) = (cache / budget_cache.CACHE_NAMESPACE).glob("*.json")
    path = tmp_path / budget_cache.CACHE_NAMESPACE / entry.name
    plant(path, kind)
    budget_cache._VERIFIED.clear()
    with no_hang():
        again = calibrate(**QUESTION, cache_dir=tmp_path)
    assert not again.cached and again.schedule == first.schedule
    assert again.bounds.upper == first.bounds.upper


@pytest.mark.parametrize("kind", [*KINDS, "bad_risk"])
def test_the_layer_risk_cache_is_rebuilt(kind: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 1 itself is replaced by a known answer: what is tested is the cache around it."""
    calls: list[int] = []

    def stage1(**_: Any) -> dict[str, Any]:
        calls.append(1)
        return {"risk": [0.4, 0.3, 0.2, 0.1], "risk_meta": {"attack_accuracy": [0.5] * 4}}

    monkeypatch.setattr(layer_risk, "compute_layer_risk", stage1)

    def factory() -> Any:
        return build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10)

    stage = layer_risk.Stage1(examples=0, steps=1, batch_size=8, lr=0.1, attack="logistic",
                              er_eval="held_out")
    args = {"data": digits(), "model_factory": factory, "seed": 0, "stage1": stage,
            "cache_dir": tmp_path}
    first = layer_risk.estimate_layer_risk(**args)
    (path,) = (tmp_path / layer_risk.CACHE_NAMESPACE).glob("*.json")
    if kind == "bad_risk":
        entry = json.loads(path.read_text())
        entry["value"]["risk"] = [0.4, "x", None]
        path.write_text(json.dumps(entry))
    else:
        plant(path, kind)
    with no_hang():
        again = layer_risk.estimate_layer_risk(**args)
    assert again["risk"] == first["risk"] and len(calls) == 2

