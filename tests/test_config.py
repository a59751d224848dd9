"""Config: documented defaults, strict validation with one clear error naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import UserInputError
from orchestrator import config


def _load(tmp_path: Path, text: str) -> config.Config:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return config.load(p)


def test_defaults_are_valid_and_round_trip(tmp_path: Path) -> None:
    cfg = config.Config()
    assert cfg.data.dataset == "digits"
    assert cfg.split_sizes() == {"train": 600, "holdout": 300, "test": 297, "shadow": 600}
    assert _load(tmp_path, cfg.to_toml()) == cfg
    assert _load(tmp_path, "") == cfg


def test_describe_documents_every_field() -> None:
    text = config.describe()
    for section, cls in config._SECTION_TYPES.items():
        assert f"[{section}]" in text
        for f in config.fields(cls):
            assert f"\n{f.name} = " in text, f.name
    # the documented defaults parse back to the default config
    assert config.from_dict(config.tomllib.loads(text)) == config.Config()


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("[training]\nlrr = 0.1\n", "training.lrr", "unknown key"),
        ("[trainig]\nlr = 0.1\n", "trainig", "unknown section"),
        ("[privacy]\nepsilon = -1\n", "privacy.epsilon", "> 0"),
        ("[privacy]\ndelta = 1.5\n", "privacy.delta", "< 1"),
        ("[privacy]\ndelta = 0.01\n", "privacy.delta", "1/train_size"),
        ("[privacy]\nepsilon = 'three'\n", "privacy.epsilon", "a float"),
        ("[privacy]\nepsilon = nan\n", "privacy.epsilon", "finite"),
        ("[training]\nepochs = 0\n", "training.epochs", ">= 1"),
        ("[training]\nepochs = 2.5\n", "training.epochs", "an integer"),
        ("[training]\nmethod = 'sgd'\n", "training.method", "dpsgd"),
        ("[training]\nbatch_size = 5000\n", "training.batch_size", "train_size"),
        ("[data]\ndataset = 'imagenet'\n", "data.dataset", "fashion-mnist"),
        ("[data]\ntrain_size = 1500\n", "data.sizes", "1797"),
        ("[data]\ndataset = 'fashion-mnist'\ntest_size = 20000\n", "data.test_size", "10000"),
        ("[model]\nname = 'resnet'\n", "model.name", "cnn28"),
        ("[resources]\ndevice = 'cuda'\n", "resources.gpus_per_trial", "> 0"),
        ("[resources]\ncpus_per_trial = true\n", "resources.cpus_per_trial", "an integer"),
        ("data = 3\n", "data", "table"),
    ],
)
def test_bad_values_name_field_value_and_allowed(tmp_path: Path, text: str, field: str,
                                                  fragment: str) -> None:
    with pytest.raises(UserInputError) as exc:
        _load(tmp_path, text)
    assert exc.value.field == field
    assert fragment in str(exc.value)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="CONFIG"):
        config.load(tmp_path / "missing.toml")
    with pytest.raises(UserInputError, match="valid TOML"):
        _load(tmp_path, "[data\n")


def test_fashion_mnist_sizes_default_to_official_test_set(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "[data]\ndataset = 'fashion-mnist'\n")
    assert cfg.split_sizes() == {"train": 30000, "holdout": 10000, "test": 10000,
                                 "shadow": 20000}
