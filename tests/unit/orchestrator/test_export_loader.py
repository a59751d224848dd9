"""``load.py`` (``orchestrator.release.loader``, copied into every export): the normalisation is
inside the model, only the hashed source of ``code/`` is ever imported (never a bytecode cache,
an extension, a ``.pth`` or any other file beside it, never a same-named module from elsewhere),
and an incomplete export is refused in one line naming the file.

The release comes from ``test_export``'s fixtures (a tiny digits trial with the built-in CNN,
whose ``code/`` is dpsweep's own ``core`` and ``trainables``). This process has imported
dpsweep's own packages, so a built-in export is loaded in a fresh ``python -I -S`` in
tests/contract/test_export_fresh_process.py; a hand-made export with module names of its own is
loaded here, in this process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dpsweep.orchestrator.release import loader
from dpsweep.orchestrator.release.bundle import RELEASE_FILES, ExportResult, export_trial
from tests.unit.orchestrator.test_export import Trained, _train

NETWORKS = "dpsweep/trainables/models/networks.py"
#: The message for a file in code/ that model.json does not list.
UNLISTED = "load: code/{} is not a hashed source file of this export; refusing to import"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return _train(tmp_path_factory.mktemp("secret"), randomness="secret")


@pytest.fixture(scope="module")
def release(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("releases") / "release"
    export_trial(checkpoint_dir=trained.checkpoint, privacy=trained.record(), out=out)
    return out


def _copy(release: Path, where: Path) -> Path:
    shutil.copytree(release, where)
    return where


# --------------------------------------------------------------------------------------------
# The normalisation is part of the model


def test_raw_input_applies_the_training_normalisation_exactly(trained: Trained,
                                                              release: Path) -> None:
    from dpsweep.trainables.data.splits import load_pool, normalise

    info = json.loads((release / "model.json").read_text())
    test = trained.data.test
    raw = load_pool(dataset="digits").x[test.indices]
    assert torch.equal(normalise(raw, dataset="digits"), test.x)  # the raw rows of the split
    wrapped = loader.RawInput(torch.nn.Identity(), normalization=info["input_normalization"],
                              input_shape=info["input_shape"], classes=info["classes"])
    assert torch.equal(wrapped(torch.from_numpy(raw)), test.x)
    with pytest.raises(ValueError, match=r"raw inputs of shape \[N, 1, 8, 8\]"):
        wrapped(torch.from_numpy(raw[0]))


# --------------------------------------------------------------------------------------------
# code/ holds the hashed source and nothing else


def _so(code: Path) -> str:
    name = "dpsweep/trainables/models/_fast.cpython-311-x86_64-linux-gnu.so"
    (code / name).write_bytes(b"\x7fELF")
    return UNLISTED.format(name)


def _pth(code: Path) -> str:
    (code / "evil.pth").write_text("import os; os.environ['PLANTED'] = '1'\n")
    return UNLISTED.format("evil.pth")


def _stray_py(code: Path) -> str:
    (code / "dpsweep/trainables/models/extra.py").write_text("raise SystemExit('planted')\n")
    return UNLISTED.format("dpsweep/trainables/models/extra.py")


def _pyc(code: Path) -> str:
    (code / "dpsweep/trainables/models/__pycache__").mkdir()
    name = "dpsweep/trainables/models/__pycache__/networks.cpython-311.pyc"
    (code / name).write_bytes(b"\0" * 16)
    return UNLISTED.format(name)


def _empty_cache_folder(code: Path) -> str:
    (code / "dpsweep/trainables/__pycache__").mkdir()
    return ("load: code/dpsweep/trainables/__pycache__ is not a folder of the hashed source of "
            "this export; refusing to import")


def _linked_source(code: Path) -> str:
    """A listed name, with the listed bytes, but a symbolic link to a file outside."""
    outside = code.parent.parent / "outside.py"
    shutil.copy(code / NETWORKS, outside)
    (code / NETWORKS).unlink()
    (code / NETWORKS).symlink_to(outside)
    return (f"load: code/{NETWORKS} is a symbolic link, not a hashed source file of this "
            f"export; refusing to import")


def _two_strays(code: Path) -> str:
    (code / "a.pth").write_text("x\n")
    (code / "b.pth").write_text("x\n")
    return ("load: code/a.pth is not a hashed source file of this export (1 more unlisted); "
            "refusing to import")


@pytest.mark.parametrize("plant", [_so, _pth, _stray_py, _pyc, _empty_cache_folder,
                                   _linked_source, _two_strays],
                         ids=lambda f: f.__name__.strip("_"))
def test_anything_beside_the_hashed_source_is_refused(release: Path, tmp_path: Path,
                                                      plant: object) -> None:
    copy = _copy(release, tmp_path / "copy")
    message = plant(copy / "code")  # type: ignore[operator]
    finders = list(sys.meta_path)
    with pytest.raises(loader.CodeRefused) as info:
        loader.load(copy)
    assert str(info.value) == message
    assert isinstance(info.value, ImportError) and isinstance(info.value, loader.ExportError)
    assert sys.meta_path == finders and "PLANTED" not in os.environ  # nothing imported


def test_changed_or_missing_source_or_a_taken_name_is_refused(release: Path,
                                                              tmp_path: Path) -> None:
    copy = _copy(release, tmp_path / "copy")
    # Intact, but this process imported dpsweep's own trainables: refused, never mixed.
    with pytest.raises(loader.CodeRefused, match="already imported from elsewhere"):
        loader.load(copy)
    networks = copy / "code" / NETWORKS
    networks.write_bytes(networks.read_bytes() + b"\n# edited\n")
    with pytest.raises(loader.CodeRefused, match=f"^load: code/{NETWORKS} changed since "
                                                 f"export .*; refusing to import$"):
        loader.load(copy)
    networks.unlink()
    with pytest.raises(loader.CodeRefused, match=f"^load: code/{NETWORKS} is missing"):
        loader.load(copy)


# --------------------------------------------------------------------------------------------
# An incomplete export: one line naming the file


def _no_model(copy: Path) -> str:
    (copy / "model.json").unlink()
    return f"load: {copy / 'model.json'} is missing: not a complete dpsweep export"


def _bad_model(copy: Path) -> str:
    (copy / "model.json").write_text("{\"build\": ")
    return f"load: {copy / 'model.json'} is not valid JSON (JSONDecodeError: "


def _thin_model(copy: Path) -> str:
    (copy / "model.json").write_text('{"classes": []}')
    return f"load: {copy / 'model.json'} lacks build, code, input_shape"


def _no_weights(copy: Path) -> str:
    (copy / "weights.pt").unlink()
    return f"load: {copy / 'weights.pt'} is missing (model.json names it as the weights)"


def _bad_weights(copy: Path) -> str:
    (copy / "weights.pt").write_bytes(b"not a torch file")
    return f"load: {copy / 'weights.pt'} is not a weights file torch can read safely ("


@pytest.mark.parametrize("damage", [_no_model, _bad_model, _thin_model, _no_weights,
                                    _bad_weights], ids=lambda f: f.__name__.strip("_"))
def test_an_incomplete_export_is_one_line_naming_the_file(
        release: Path, tmp_path: Path, damage: object,
        capsys: pytest.CaptureFixture[str]) -> None:
    copy = _copy(release, tmp_path / "copy")
    start = damage(copy)  # type: ignore[operator]
    with pytest.raises(loader.ExportError) as info:
        loader.load(copy)
    assert str(info.value).startswith(start) and "\n" not in str(info.value)
    capsys.readouterr()
    assert loader.main([str(copy)]) == loader.EXIT_REFUSED  # python load.py DIR
    out, err = capsys.readouterr()
    assert out == "" and err == f"{info.value}\n"


# --------------------------------------------------------------------------------------------
# The import itself: hashed bytes only, first for the export's names, no bytecode written

PACKAGE = "xq_loader_nets"
TOOLS = "xq_loader_tools"
#: A user's factory: its forward imports a submodule late, as some networks do.
FACTORY = f"""\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, 2)

    def forward(self, x):
        from {PACKAGE}.late import double
        return double(self.fc(x))


def small(input_shape, num_classes):
    return Net(input_shape[0])
"""
#: Same-named modules earlier on sys.path: none of them may be imported for the export.
SHADOW = "raise RuntimeError('the shadow was imported')\n"


@pytest.fixture
def user_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A hand-made export of a user's factory, and a shadow folder first on sys.path holding
    modules of the same names (and one the export lacks)."""
    files = {f"{PACKAGE}/__init__.py": "", f"{PACKAGE}/build.py": FACTORY,
             f"{PACKAGE}/late.py": "def double(x):\n    return 2 * x\n",
             f"{TOOLS}.py": "ORIGIN = 'export'\n"}
    export = tmp_path / "export"
    for name, text in files.items():
        (export / "code" / name).parent.mkdir(parents=True, exist_ok=True)
        (export / "code" / name).write_text(text)
    torch.save({"fc.weight": torch.eye(2, 4), "fc.bias": torch.zeros(2)},
               export / "weights.pt")
    (export / "model.json").write_text(json.dumps({
        "build": {"factory": f"{PACKAGE}.build:small", "args": {}},
        "code": {"dir": "code", "files": {
            name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()}},
        "input_shape": [4], "num_classes": 2, "classes": ["a", "b"],
        "input_normalization": {"max_value": 1.0, "mean": [0.0] * 4, "std": [1.0] * 4},
        "weights": {"torch": "weights.pt"}}))
    shadow = tmp_path / "shadow"
    for name in (*files, f"{PACKAGE}/absent.py"):
        (shadow / name).parent.mkdir(parents=True, exist_ok=True)
        (shadow / name).write_text(SHADOW)
    (shadow / f"{TOOLS}.py").write_text("ORIGIN = 'shadow'\n")
    monkeypatch.syspath_prepend(str(shadow))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # restored afterwards
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # a bytecode write would happen
    yield export
    for name in [n for n in sys.modules if n.startswith((PACKAGE, TOOLS))]:
        del sys.modules[name]


def test_the_export_imports_only_its_hashed_source(user_export: Path) -> None:
    model = loader.load(user_export)
    with torch.no_grad():  # forward imports PACKAGE.late now, after load returned
        assert torch.equal(model(torch.tensor([[1.0, 2.0, 3.0, 4.0]])),
                           torch.tensor([[2.0, 4.0]]))
    code = user_export / "code"
    for name in (f"{PACKAGE}.build", f"{PACKAGE}.late"):
        assert sys.modules[name].__file__ == str(code / f"{name.replace('.', '/')}.py")
    assert not list(code.rglob("__pycache__"))  # compiled from the bytes: no cache written
    with pytest.raises(ModuleNotFoundError, match=f"no module '{PACKAGE}.absent' in this "
                                                  f"export's code/"):
        importlib.import_module(f"{PACKAGE}.absent")  # the shadow has it: never taken
    assert loader.load(user_export).classes == ["a", "b"]  # again, in the same process
    # A name the export provides but load never imported is left to the rest of the path ...
    assert importlib.import_module(TOOLS).ORIGIN == "shadow"
    # ... and once taken from there, the export is refused rather than mixed with it.
    with pytest.raises(loader.CodeRefused, match=f"a module '{TOOLS}' is already imported "
                                                 f"from elsewhere"):
        loader.load(user_export)


def test_load_py_run_as_a_script_says_what_it_loaded(user_export: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert loader.main([str(user_export)]) == 0
    assert capsys.readouterr().out == (f"load: {user_export}: raw inputs [N, 4] -> logits over "
                                       f"2 classes (a, b)\n")


# --------------------------------------------------------------------------------------------
# What `dpsweep export` prints


def _result(out: Path, *, code: int, degenerate: str | None = None) -> ExportResult:
    files = (*RELEASE_FILES[:4], *(f"code/m{i}.py" for i in range(code)), *RELEASE_FILES[4:])
    return ExportResult(out=out, files=files, model={"degenerate": degenerate},
                        statement=SimpleNamespace(headline="HEADLINE"))  # type: ignore[arg-type]


@pytest.mark.parametrize("code,counted", [(1, "1 file"), (3, "3 files"), (0, "0 files")])
def test_the_summary_counts_the_code_files(tmp_path: Path, code: int, counted: str) -> None:
    assert _result(tmp_path, code=code).summary() == (
        f"exported {tmp_path}: weights.pt, model.safetensors, model.json, load.py, "
        f"code/ ({counted}), privacy_statement.json, privacy_statement.md\nHEADLINE")


def test_pick_export_says_exported_once(tmp_path: Path) -> None:
    """``pick --export`` puts the export's summary under its own ``exported`` label."""
    from dpsweep.orchestrator.release.pick import _tail

    summary = _result(tmp_path / "rel", code=1, degenerate="at chance").summary()
    pick = SimpleNamespace(checkpoint="ckpt", path=tmp_path / "pick.toml",
                           export_summary=summary)
    lines = _tail(pick)  # type: ignore[arg-type]
    assert lines[-3:] == [
        f"  exported             {tmp_path / 'rel'}: weights.pt, model.safetensors, model.json, "
        f"load.py, code/ (1 file), privacy_statement.json, privacy_statement.md",
        f"  {'':<20} WARNING: at chance",
        f"  {'':<20} HEADLINE"]
