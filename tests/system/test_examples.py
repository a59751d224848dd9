"""Every folder in ``examples/`` runs as the README says, at a small size: its data script, its
config checked, one short sweep; the BatchNorm example is refused with its fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dpsweep.orchestrator.config import read_toml
from dpsweep.reports.store import read_results

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
BIN = Path(sys.executable).parent
#: The examples' configs at a size CI can afford (the sweep and sizes sections replaced).
SMALL = {"training": {"epochs": 1, "batch_size": 64},
         "sweep": {"trials_per_method": 1, "max_concurrent_trials": 2, "baseline": False},
         "audit": {"enabled": False}}


def _shrink(config: Path, sizes: dict[str, int]) -> None:
    import tomli_w

    raw = read_toml(config)
    for section, values in SMALL.items():
        raw.setdefault(section, {}).update(values)
    raw["data"].update({f"{k}_size": v for k, v in sizes.items()})
    config.write_text(tomli_w.dumps(raw))


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the data scripts import dpsweep's loaders
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_every_example_is_listed_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    folders = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    assert folders == ["batchnorm_refused", "fashion_cnn", "frozen_backbone", "stock_models",
                       "tabular_digits"]
    for name in folders:
        assert f"examples/{name}" in readme, name


#: Each example at CI size: its data script's arguments and the split sizes.
SMALL_RUNS = {
    "tabular_digits": ([], {"train": 500, "validation": 100, "holdout": 200, "test": 200,
                            "shadow": 200}),
    "fashion_cnn": (["--limit", "1200"], {"train": 500, "validation": 150, "holdout": 150,
                                          "test": 150, "shadow": 250}),
    "frozen_backbone": ([], {"train": 200, "validation": 100, "holdout": 100, "test": 100,
                             "shadow": 100}),
}
#: An example whose data script writes ``sweep.toml`` from this template (it fills in a path).
TEMPLATE = "sweep.template.toml"


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Every runnable example as the README says (its data script, `config --check`, a sweep),
    the examples side by side on the two cores: name -> (folder, the first failure's output)."""
    procs: dict[str, tuple[Path, subprocess.Popen[str]]] = {}
    for name, (script_args, sizes) in SMALL_RUNS.items():
        if name == "fashion_cnn" and not Path("/usr/share/datasets/fashion-mnist").is_dir():
            continue
        root = tmp_path_factory.mktemp(name)
        folder = root / name
        shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns(
            "digits_png", "*.pt", "__pycache__"))
        templated = (folder / TEMPLATE).is_file()
        _shrink(folder / (TEMPLATE if templated else "sweep.toml"), sizes)
        steps = " && ".join([
            " ".join([sys.executable, "make_data.py", *script_args]),
            f"{BIN / 'dpsweep'} config --check sweep.toml",
            f"{BIN / 'dpsweep'} run {folder / 'sweep.toml'} --out {root / 'run'} --quiet"])
        env = {**os.environ, "PYTHONPATH": str(REPO)}  # the data scripts import the loaders
        procs[name] = (folder, subprocess.Popen(["bash", "-c", steps], cwd=folder, env=env,
                                                stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True))
    out: dict[str, tuple[Path, str]] = {}
    for name, (folder, proc) in procs.items():
        text, _ = proc.communicate(timeout=600)
        out[name] = (folder, "" if proc.returncode == 0 else text[-3000:])
    return out


@pytest.mark.parametrize("name", list(SMALL_RUNS))
def test_an_example_runs_end_to_end(name: str,
                                    example_runs: dict[str, tuple[Path, str]]) -> None:
    if name not in example_runs:
        pytest.skip("Fashion-MNIST is not on this machine (`make data`)")
    folder, failure = example_runs[name]
    assert failure == "", failure
    frame = read_results(folder.parent / "run")
    methods = read_toml(folder / "sweep.toml")["sweep"]["methods"]
    assert len(frame) == len(methods) and (frame["status"] == "ok").all(), frame["error"]


def test_the_batchnorm_example_is_refused_with_its_fix(tmp_path: Path) -> None:
    folder = EXAMPLES / "batchnorm_refused"
    # the comment's own fix: uncommented, the same check passes (both checks run at once)
    shutil.copy(folder / "bn_model.py", tmp_path)
    text = (folder / "sweep.toml").read_text()
    assert "\n# fix = true\n" in text
    (tmp_path / "sweep.toml").write_text(text.replace("\n# fix = true\n", "\nfix = true\n"))
    with ThreadPoolExecutor(2) as pool:
        refused, fixed = pool.map(
            lambda config: _run(str(BIN / "dpsweep"), "config", "--check", str(config),
                                cwd=REPO),
            [folder / "sweep.toml", tmp_path / "sweep.toml"])
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.factory = 'bn_model:build'" in lines[0]
    assert "set [model] fix = true" in lines[0] and "1 BatchNorm module ('1')" in lines[0]
    assert fixed.returncode == 0, fixed.stderr
