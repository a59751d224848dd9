"""A user's model and data in a config: paths resolved against the config file, the code and
files hashed into the run's manifest, and ``resume`` refusing a run whose inputs changed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator import api
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.rundir import RunDir

MODULE = ("from torch import nn\n\n\ndef build(input_shape, num_classes, hidden=16):\n"
          "    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.Tanh(),\n"
          "                         nn.Linear(hidden, num_classes))\n")
CONFIG = """\
[data]
dataset = "file"
path = "data/digits.npz"
[model]
factory = "sources_net:build"
args = {hidden = 12}
[training]
epochs = 1
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "digits.npz", x=digits.data.astype(np.float32),
             y=digits.target.astype(np.int64))
    (tmp_path / "sources_net.py").write_text(MODULE)
    (tmp_path / "sweep.toml").write_text(CONFIG)
    return tmp_path


def test_paths_resolve_against_the_config_file_and_the_network_is_checked(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(project.parent)  # not where the config is
    cfg = api.load_config(project / "sweep.toml")
    assert cfg.data.path == str(project / "data" / "digits.npz")
    assert cfg.model.code_dir == str(project)
    setup = check(cfg)
    assert setup.num_layers == 2 and setup.num_classes == 10
    sizes = setup.split_sizes
    assert sum(sizes.values()) == 1797 and sizes["train"] == 1797 - sum(
        v for k, v in sizes.items() if k != "train")
    assert set(setup.input_fingerprints()) == {"model_code", "data.path"}


def test_resume_refuses_a_run_whose_code_or_data_changed(
        project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = api.load_config(project / "sweep.toml")
    run = RunDir.create(project / "run", config_text=cfg.to_toml(),
                        inputs=check(cfg).input_fingerprints())
    run.release()
    run = RunDir.open(project / "run", write=False)
    run.check_inputs(check(cfg).input_fingerprints())  # unchanged: accepted

    (project / "sources_net.py").write_text(MODULE.replace("nn.Tanh()", "nn.ReLU()"))
    with pytest.raises(UserInputError, match="restore them, or start a new run") as err:
        run.check_inputs(check(api.load_config(project / "sweep.toml")).input_fingerprints())
    assert err.value.field == "manifest.json.inputs.model_code"

    capsys.readouterr()
    assert main(["resume", str(project / "run"), "--quiet"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.count("\n") == 0 and "manifest.json.inputs.model_code" in line

    (project / "sources_net.py").write_text(MODULE)  # the code back, the data changed
    with np.load(project / "data" / "digits.npz") as arrays:
        x, y = arrays["x"], arrays["y"]
    np.savez(project / "data" / "digits.npz", x=x[::-1].copy(), y=y[::-1].copy())
    with pytest.raises(UserInputError) as err:
        run.check_inputs(check(api.load_config(project / "sweep.toml")).input_fingerprints())
    assert err.value.field == "manifest.json.inputs.data.path"


def test_a_second_folder_with_a_module_of_the_same_name_gets_its_own(tmp_path: Path) -> None:
    from dpsweep.trainables.models import usercode

    for name, width in (("one", 3), ("two", 5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "same_name_net.py").write_text(f"WIDTH = {width}\ndef build(): pass\n")
    first = usercode.resolve(field="f", reference="same_name_net:build", code_dir=tmp_path / "one")
    second = usercode.resolve(field="f", reference="same_name_net:build",
                              code_dir=tmp_path / "two")
    assert first.__globals__["WIDTH"] == 3 and second.__globals__["WIDTH"] == 5


def test_a_user_trials_spec_maps_back_onto_its_config(project: Path) -> None:
    """What ``pick`` writes to retrain a trial names the same network and data."""
    from dpsweep.orchestrator.trial.plan import config_from_spec, plan_trial

    setup = check(api.load_config(project / "sweep.toml"))
    spec = plan_trial(setup, method="dpsgd", cache_dir=project / "cache").to_dict()
    again = check(config_from_spec(spec))
    assert again.model_source == setup.model_source
    assert again.file_source == setup.file_source
    assert again.split_sizes == setup.split_sizes
