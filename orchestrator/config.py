"""The sweep config: a TOML file whose every field has a documented default.

Validation is strict and happens before anything is written: unknown sections or keys, wrong
types and out-of-range values each raise one :class:`UserInputError` naming the field
(``section.key``), the value and what is allowed. ``describe()`` renders the documented
defaults (``dpsweep config``), so the README and the code cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w

from core.errors import UserInputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Dataset sizes the static checks need before any data is read: (official train, official test);
# digits has no official test split, so its whole pool is in the first number.
DATASET_POOLS: dict[str, tuple[int, int]] = {
    "digits": (1797, 0),
    "fashion-mnist": (60000, 10000),
    "mnist": (60000, 10000),
    "cifar10": (50000, 10000),
}


def _f(default: Any, doc: str, **rules: Any) -> Any:
    """A config field: default, one-line doc, and validation rules (choices, lo, hi, lo_open)."""
    meta = {"doc": doc, **rules}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _f("digits", "dataset name", choices=tuple(DATASET_POOLS))
    data_dir: str = _f("", "directory with the dataset's files; '' = built-in lookup "
                           "(Debian's /usr/share/datasets for fashion-mnist, else download)")
    split_seed: int = _f(0, "seed of the train/holdout/test/shadow split", lo=0)
    train_size: int = _f(0, "private training examples (members); 0 = dataset default", lo=0)
    holdout_size: int = _f(0, "private non-members for the audit; 0 = dataset default", lo=0)
    test_size: int = _f(0, "test examples; 0 = dataset default", lo=0)
    shadow_size: int = _f(0, "public shadow pool; 0 = dataset default", lo=0)


@dataclass(frozen=True)
class ModelConfig:
    name: str = _f("auto", "model; 'auto' = digits_cnn for digits, cnn28 for 28x28, cnn5 for "
                           "cifar10", choices=("auto", "digits_cnn", "cnn28", "cnn5"))
    activation: str = _f("tanh", "hidden activation", choices=("tanh", "relu"))


@dataclass(frozen=True)
class PrivacyConfig:
    epsilon: float = _f(3.0, "target epsilon every trial is held to", lo=0.0, lo_open=True,
                        hi=100.0)
    delta: float = _f(1e-5, "target delta; must be below 1 / train_size", lo=0.0, lo_open=True,
                      hi=1.0, hi_open=True)
    accountant_timeout_s: float = _f(120.0, "time bound of one PRV calibration before falling "
                                            "back to Opacus RDP (recorded)", lo=1.0)


@dataclass(frozen=True)
class TrainingConfig:
    method: str = _f("dpsgd", "method of a single-trial run (the demo's until the sweep lands)")
    preset: str = _f("", "start from the method's named preset ('paper' = the paper's defaults, "
                         "including lr and clip_norm); '' = none")
    batch_size: int = _f(64, "expected Poisson batch size; sample rate = 1/ceil(N/batch_size)",
                         lo=1)
    epochs: int = _f(20, "training epochs", lo=1, hi=10000)
    lr: float = _f(0.5, "learning rate", lo=0.0, lo_open=True, hi=100.0)
    clip_norm: float = _f(1.0, "per-example clipping norm C", lo=0.0, lo_open=True, hi=1e4)
    momentum: float = _f(0.0, "SGD momentum", lo=0.0, hi=1.0, hi_open=True)
    max_physical_batch: int = _f(512, "examples per vmap chunk (memory bound; no effect on "
                                      "results)", lo=1)
    seed: int = _f(0, "seed of model init, sampling and noise", lo=0)


@dataclass(frozen=True)
class ResourcesConfig:
    cpus_per_trial: int = _f(1, "CPUs per trial; torch threads are set to this", lo=1)
    gpus_per_trial: float = _f(0.0, "GPUs per trial (fractions allowed)", lo=0.0, hi=8.0)
    device: str = _f("auto", "'auto' (CUDA when present), 'cpu' or 'cuda'",
                     choices=("auto", "cpu", "cuda"))


ALL_METHODS = ["dpsgd", "lm_dpsgd", "ww_dpsgd", "dp_adamilg", "dpsgd_lf"]


@dataclass(frozen=True)
class SweepConfig:
    methods: list = _f(ALL_METHODS, "methods to compare, one Optuna study each")  # noqa: RUF009
    trials_per_method: int = _f(4, "trials per method (equal budgets; the first is the paper "
                                    "preset)", lo=1, hi=10000)
    max_concurrent_trials: int = _f(2, "trials running at once (bounded by the cluster's CPUs)",
                                    lo=1)
    seed: int = _f(0, "seed of the Optuna samplers", lo=0)


@dataclass(frozen=True)
class AuditConfig:
    enabled: bool = _f(True, "attack every trained model with per-layer shadow-model MIAs")
    in_trial: bool = _f(True, "audit inside each trial (two-objective search: accuracy up, peak "
                              "MIA down); false = accuracy-only search, audit afterwards")
    shadow_models: int = _f(1, "shadow models per audited trial", lo=1, hi=16)
    seed: int = _f(0, "seed of the shadow split, shadow training and attack classifiers", lo=0)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    #: Method hyperparameters beyond lr and clip_norm (checked by the method itself).
    method_params: dict[str, Any] = field(default_factory=dict)

    def trial_params(self) -> dict[str, Any]:
        """lr, clip_norm, momentum and method params after applying the preset."""
        from trainables.methods import get_method

        cls = get_method(self.training.method)
        preset = dict(cls.presets[self.training.preset]) if self.training.preset else {}
        base = {"lr": self.training.lr, "clip_norm": self.training.clip_norm,
                "momentum": self.training.momentum}
        for key in ("lr", "clip_norm", "momentum"):
            if key in preset:
                base[key] = preset.pop(key)
        params = cls.validate_params({**preset, **self.method_params})
        return {**base, "method_params": params}

    def split_sizes(self) -> dict[str, int]:
        """Split sizes with dataset defaults filled in."""
        from trainables.data import DEFAULT_SIZES

        d = DEFAULT_SIZES[self.data.dataset]
        return {
            "train": self.data.train_size or d.train,
            "holdout": self.data.holdout_size or d.holdout,
            "test": self.data.test_size or d.test,
            "shadow": self.data.shadow_size or d.shadow,
        }

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not d["method_params"]:
            del d["method_params"]
        return d

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


_SECTION_TYPES = {"data": DataConfig, "model": ModelConfig, "privacy": PrivacyConfig,
                  "training": TrainingConfig, "resources": ResourcesConfig,
                  "sweep": SweepConfig, "audit": AuditConfig}


_KIND_NAMES = {int: "an integer", float: "a float", str: "a string", bool: "a boolean",
               list: "a list"}


def _check_value(section: str, f: dataclasses.Field, value: Any) -> Any:
    name = f"{section}.{f.name}"
    meta = f.metadata
    kind = type(f.default) if f.default is not dataclasses.MISSING else list
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is bool or isinstance(value, bool):
        if not isinstance(value, bool) or kind is not bool:
            raise UserInputError(field=name, value=value, allowed=_KIND_NAMES[kind])
    if not isinstance(value, kind):
        raise UserInputError(field=name, value=value, allowed=_KIND_NAMES[kind])
    if kind is float and not math.isfinite(value):
        raise UserInputError(field=name, value=value, allowed="a finite number")
    if "choices" in meta and value not in meta["choices"]:
        raise UserInputError(field=name, value=value, allowed=f"one of {list(meta['choices'])}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value < lo or (meta.get("lo_open") and value == lo)):
        op = ">" if meta.get("lo_open") else ">="
        raise UserInputError(field=name, value=value, allowed=f"a number {op} {lo}")
    if hi is not None and (value > hi or (meta.get("hi_open") and value == hi)):
        op = "<" if meta.get("hi_open") else "<="
        raise UserInputError(field=name, value=value, allowed=f"a number {op} {hi}")
    return value


def _section(section: str, raw: Any) -> Any:
    cls = _SECTION_TYPES[section]
    if not isinstance(raw, dict):
        raise UserInputError(field=section, value=raw, allowed="a table of keys")
    known = {f.name: f for f in fields(cls)}
    for key in raw:
        if key not in known:
            raise UserInputError(field=f"{section}.{key}", value=raw[key],
                                 allowed=f"one of the keys {sorted(known)} (unknown key)")
    return cls(**{k: _check_value(section, known[k], v) for k, v in raw.items()})


def from_dict(raw: dict[str, Any]) -> Config:
    """Build and fully validate a config from parsed TOML."""
    raw = dict(raw)
    method_params = raw.pop("method_params", {})
    if not isinstance(method_params, dict):
        raise UserInputError(field="method_params", value=method_params,
                             allowed="a table of the method's hyperparameters")
    for key in raw:
        if key not in _SECTION_TYPES:
            raise UserInputError(field=key, value=raw[key] if not isinstance(raw[key], dict)
                                 else "[table]",
                                 allowed=f"one of the sections {sorted(_SECTION_TYPES)} "
                                         "(unknown section)")
    cfg = Config(**{k: _section(k, v) for k, v in raw.items()}, method_params=method_params)
    _cross_checks(cfg)
    return cfg


def load(path: str | Path) -> Config:
    p = Path(path)
    if not p.is_file():
        raise UserInputError(field="CONFIG", value=str(p), allowed="an existing TOML file")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserInputError(field="CONFIG", value=str(p), allowed=f"valid TOML ({exc})") from None
    return from_dict(raw)


def _cross_checks(cfg: Config) -> None:
    from trainables.methods import METHODS

    if cfg.training.method not in METHODS:
        raise UserInputError(field="training.method", value=cfg.training.method,
                             allowed=f"one of {sorted(METHODS)}")
    presets = METHODS[cfg.training.method].presets
    if cfg.training.preset and cfg.training.preset not in presets:
        raise UserInputError(field="training.preset", value=cfg.training.preset,
                             allowed=f"'' or a preset of {cfg.training.method}: "
                                     f"{sorted(presets) or 'none'}")
    cfg.trial_params()  # the method checks its own hyperparameters
    sizes = cfg.split_sizes()
    pool, official_test = DATASET_POOLS[cfg.data.dataset]
    if official_test:
        if sizes["test"] > official_test:
            raise UserInputError(field="data.test_size", value=sizes["test"],
                                 allowed=f"<= {official_test} (the official test set)")
        used = sizes["train"] + sizes["holdout"] + sizes["shadow"]
        what = "train_size + holdout_size + shadow_size"
    else:
        used = sum(sizes.values())
        what = "train_size + holdout_size + test_size + shadow_size"
    if used > pool:
        raise UserInputError(field="data.sizes", value=f"{what} = {used}",
                             allowed=f"<= {pool} examples available in {cfg.data.dataset}")
    n = sizes["train"]
    if cfg.privacy.delta >= 1.0 / n:
        raise UserInputError(field="privacy.delta", value=cfg.privacy.delta,
                             allowed=f"< 1/train_size = {1.0 / n:.3g} (a larger delta permits "
                                     "releasing whole examples)")
    if cfg.training.batch_size > n:
        raise UserInputError(field="training.batch_size", value=cfg.training.batch_size,
                             allowed=f"<= train_size = {n}")
    methods = cfg.sweep.methods
    if not methods or any(not isinstance(m, str) or m not in METHODS for m in methods) or len(
            set(methods)) != len(methods):
        raise UserInputError(field="sweep.methods", value=methods,
                             allowed=f"a non-empty list of distinct names from {sorted(METHODS)}")
    if cfg.resources.device == "cuda" and cfg.resources.gpus_per_trial == 0:
        raise UserInputError(field="resources.gpus_per_trial", value=0.0,
                             allowed="> 0 when resources.device = 'cuda'")


def describe() -> str:
    """The documented defaults as a commented TOML file."""
    lines = ["# dpsweep config: every key with its default. Unknown keys are an error.",
             "# [method_params] (optional): the method's own hyperparameters, e.g. r = 2.0 for",
             "# lm_dpsgd; each method documents and checks its keys.", ""]
    for section, cls in _SECTION_TYPES.items():
        lines.append(f"[{section}]")
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if isinstance(default, list):
                value = "[" + ", ".join(f'"{v}"' for v in default) + "]"
            else:
                value = tomli_w.dumps({"x": default}).split("=", 1)[1].strip()
            rules = []
            if "choices" in f.metadata:
                rules.append("one of " + ", ".join(map(str, f.metadata["choices"])))
            lines.append(f"{f.name} = {value:<12} # {f.metadata['doc']}"
                         + (f" ({'; '.join(rules)})" if rules else ""))
        lines.append("")
    return "\n".join(lines)
