"""The sweep config: a TOML file whose every field has a documented default.

Every field is a :class:`core.params.Param` declared once below (type, bounds, default and
meaning); method hyperparameters are declared by the methods themselves. Validation is strict
and happens before anything is written: unknown sections or keys, wrong types and out-of-range
values each raise one :class:`UserInputError` naming the field (``section.key``), the value and
what is allowed. Rules across fields, and against the methods, the data, the model and the
machine, are checked once, by ``orchestrator.door`` (the one door every command goes through).
``describe()`` renders the documented defaults (``dpsweep config``), so the
README and the code cannot drift apart.

``[method_params]`` holds method hyperparameters (``lr``, ``clip_norm``, ``r``, ...): flat keys
apply to every method that declares them (in a sweep they are then fixed, not searched), and a
``[method_params.<method>]`` table applies to one method only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w

from dpsweep.core.datasets import FILE_DATASET, POOLS
from dpsweep.core.errors import UserInputError
from dpsweep.core.params import Param, is_real
from dpsweep.core.poisson import PHYSICAL_BATCH
from dpsweep.core.toml import tomllib
from dpsweep.orchestrator.config.checks import (
    MAX_EPSILON,
    check_plain,
    check_series_texts,
)
from dpsweep.orchestrator.config.paths import check_path_form, resolve_paths
from dpsweep.trainables.models.catalog import MODEL_NAMES

#: Model names the config accepts: the catalog's (torch-free, so validating a config never
#: imports torch), or "auto" for the dataset's default.
MODEL_CHOICES = ("auto", *MODEL_NAMES)
#: Longest sensible PRV time bound: beyond it a fallback to RDP is better than waiting.
MAX_ACCOUNTANT_TIMEOUT_S = 3600.0
#: The PRV time bound when the config does not set one (``dpsweep budget`` uses it too).
DEFAULT_ACCOUNTANT_TIMEOUT_S = 120.0
SAMPLERS = ("tpe", "random", "nsga2", "gp")
#: Largest seed of the data split, the trials and the audit: numpy and torch take 64-bit seeds
#: (and results store them as int64); a trial's re-runs add up to ``sweep.seeds`` (<= 100).
MAX_SEED = 2**63 - 1 - 100
#: MLflow's module, and how dpsweep installs it (an optional extra).
MLFLOW_MODULE = "mlflow"
MLFLOW_EXTRA = "pip install dpsweep[mlflow]"
#: Largest ``sweep.seed``: Optuna's samplers seed numpy's RandomState (< 2^32) with the seed
#: plus the study's index.
MAX_SWEEP_SEED = 2**31 - 1


def _f(default: Any, doc: str, **rules: Any) -> Any:
    """A config field: its default, one-line doc and the rules of its :class:`Param`."""
    meta = {"doc": doc, "rules": rules}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def field_param(section: str, f: dataclasses.Field) -> Param:
    """The declaration of config field ``section.f``."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return Param(f.name, default, f.metadata["doc"], **f.metadata["rules"])


def _names(value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError
    return list(value)


def _numbers(value: Any) -> list[float]:
    if not isinstance(value, (list, tuple)) or not all(is_real(v) for v in value):
        raise ValueError
    return [float(v) for v in value]


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _f("digits", "dataset name; 'file' = your own data (path or factory)",
                      choices=(*POOLS, FILE_DATASET))
    data_dir: str = _f("", "directory with the dataset's files; '' = built-in lookup "
                           "(Debian's /usr/share/datasets for fashion-mnist, else download)")
    split_seed: int = _f(0, "seed of the train/validation/holdout/test/shadow split", low=0,
                         high=MAX_SEED, allowed_text=f"an integer in [0, {MAX_SEED}]")
    train_size: int = _f(0, "private training examples (members); 0 = dataset default", low=0)
    validation_size: int = _f(0, "private validation examples (model selection); 0 = dataset "
                                 "default", low=0)
    holdout_size: int = _f(0, "private non-members for the audit; 0 = dataset default", low=0)
    test_size: int = _f(0, "test examples (reported, never a basis for choosing); 0 = dataset "
                           "default", low=0)
    shadow_size: int = _f(0, "public shadow pool; 0 = dataset default", low=0)
    path: str = _f("", "dataset = 'file': an .npz (x, y), a .parquet or .csv table, or a "
                       "class-per-folder image directory (relative to the config file)")
    factory: str = _f("", "dataset = 'file': 'package.module:function' returning (x, y), a dict "
                          "or a torch Dataset (imported from model.code_dir)")
    label_column: str = _f("label", "tables: the label column")
    feature_columns: list = _f([], "tables: feature columns; [] = every other column",  # noqa: RUF009
                               kind="list", rule=_names, allowed_text="a list of column names")
    split_column: str = _f("", "tables: a column of train/validation/holdout/test/shadow "
                               "(your splits instead of the seeded ones); '' = seeded splits")
    public_path: str = _f("", "a file of the same kind holding public examples: the shadow pool "
                              "(normalisation statistics come from it)")
    mean: list = _f([], "normalisation constants (per channel or feature); [] = from the public "  # noqa: RUF009
                        "pool", kind="list", rule=_numbers, allowed_text="a list of numbers")
    std: list = _f([], "normalisation constants, > 0; [] = from the public pool",  # noqa: RUF009
                   kind="list", rule=_numbers, allowed_text="a list of numbers")
    num_classes: int = _f(0, "dataset = 'file': number of classes; 0 = largest label + 1", low=0)
    inputs: str = _f("features", "dataset = 'file': 'features' (floats, normalised) or 'tokens' "
                                 "(integer ids, never normalised)", choices=("features", "tokens"))


@dataclass(frozen=True)
class ModelConfig:
    name: str = _f("auto", "model; 'auto' = digits_cnn for digits, cnn28 for 28x28, cnn5 for "
                           "cifar10", choices=MODEL_CHOICES)
    activation: str = _f("tanh", "hidden activation", choices=("tanh", "relu"))
    factory: str = _f("", "your model: 'package.module:function' called as function("
                          "input_shape=..., num_classes=..., **args), returning an nn.Module; "
                          "'' = the built-in [model] name")
    args: dict = _f({}, "keyword arguments for model.factory", kind="table")  # noqa: RUF009
    layers: list = _f([], "module names (dotted paths) that are the layers of model.factory's "  # noqa: RUF009
                          "network; [] = each top-level child with parameters", kind="list",
                      rule=_names, allowed_text="a list of module names")
    code_dir: str = _f("", "folder your factory modules are imported from (shipped to every Ray "
                           "worker); '' = the config file's folder")
    fix: bool = _f(False, "replace BatchNorm in model.factory's network with GroupNorm "
                          "(gcd(32, C) groups; 1 for BatchNorm1d) and drop InstanceNorm running "
                          "statistics, instead of refusing them; each trial's privacy record "
                          "lists what was replaced (method_record.model_fixes)")


@dataclass(frozen=True)
class PrivacyConfig:
    epsilon: float = _f(3.0, "target epsilon every trial is held to when budget.epsilons is "
                             "empty", low=0.0, low_open=True, high=MAX_EPSILON)
    delta: float = _f(1e-5, "target delta; must be below 1 / train_size", low=0.0, low_open=True,
                      high=1.0, high_open=True)
    accountant_timeout_s: float = _f(DEFAULT_ACCOUNTANT_TIMEOUT_S, "time bound of one PRV "
                                     "calibration before falling back to RDP (recorded)", low=1.0,
                                     high=MAX_ACCOUNTANT_TIMEOUT_S)


def _epsilon_list(value: Any) -> list[float]:
    """Distinct targets in (0, MAX_EPSILON], sorted; numbers are checked before they are
    compared, so a nested list or a table is refused, not hashed."""
    if not isinstance(value, (list, tuple)) or not all(
            is_real(v) and 0 < v <= MAX_EPSILON for v in value):
        raise ValueError
    numbers = [float(v) for v in value]
    if len(set(numbers)) != len(numbers):
        raise ValueError
    return sorted(numbers)


@dataclass(frozen=True)
class BudgetConfig:
    epsilons: list = _f(  # noqa: RUF009
        [], "target epsilons of a sweep: one study per series and target (privacy-utility "
            "curves); empty = [privacy.epsilon]", kind="list", rule=_epsilon_list,
        allowed_text=f"a list of distinct numbers in (0, {MAX_EPSILON:g}]")


@dataclass(frozen=True)
class TrainingConfig:
    method: str = _f("dpsgd", "method of a single-trial run (`dpsweep train`)")
    preset: str = _f("", "start from the method's named preset ('paper' = the paper's defaults, "
                         "including lr and clip_norm); '' = none")
    batch_size: int = _f(64, "expected Poisson batch size; sample rate = 1/ceil(N/batch_size)",
                         low=1)
    epochs: int = _f(20, "training epochs", low=1, high=10000)
    max_physical_batch: int = _f(PHYSICAL_BATCH, "examples per per-example-gradient chunk "
                                 "(memory bound; no effect on results)", low=1, high=1 << 20)
    seed: int = _f(0, "seed of model initialisation and public-batch order (never of the noise "
                      "or sampling, unless reproducible)", low=0, high=MAX_SEED,
                   allowed_text=f"an integer in [0, {MAX_SEED}]")
    reproducible: bool = _f(False, "seed the noise and Poisson sampling from `seed` too, so a "
                                   "replay is bit-identical; such trials are unsafe to release")
    secure_mode: bool = _f(False, "draw noise and sampling from a cryptographically secure "
                                  "source, with the floating-point-safe Gaussian")


@dataclass(frozen=True)
class ResourcesConfig:
    cpus_per_trial: int = _f(1, "CPUs per trial; torch threads are set to this", low=1,
                             high=1024)
    gpus_per_trial: float = _f(0.0, "GPUs per trial (fractions allowed)", low=0.0, high=16.0)
    memory_per_trial_mb: int = _f(0, "memory Ray reserves per trial in MB; 0 = none reserved "
                                     "(checked against a node's memory before any trial starts)",
                                  low=0, high=1 << 24)
    device: str = _f("auto", "'auto' (CUDA when present), 'cpu' or 'cuda'",
                     choices=("auto", "cpu", "cuda"))


@dataclass(frozen=True)
class SweepConfig:
    methods: list = _f(  # noqa: RUF009
        [], "series to compare, 'method' or 'method:mode', one Optuna study each; empty = every "
            "registered method the model can train, in its default mode", kind="list",
        rule=check_series_texts, allowed_text="a list of 'method' or 'method:mode' strings")
    trials_per_method: int = _f(4, "trials per series (equal budgets; the first is the paper "
                                   "preset); adaptive tuning only", low=1, high=10000)
    max_concurrent_trials: int = _f(2, "trials running at once (bounded by the cluster's CPUs)",
                                    low=1, high=1024)
    seed: int = _f(0, "seed of the adaptive Optuna samplers (private tuning draws its points "
                      "from OS entropy)", low=0, high=MAX_SWEEP_SEED,
                   allowed_text=f"an integer in [0, {MAX_SWEEP_SEED}]")
    sampler: str = _f("tpe", "Optuna sampler: tpe, random, nsga2 or gp", choices=SAMPLERS)
    seeds: int = _f(0, "re-runs of every front trial with fresh noise and new initialisation "
                       "(spread of the privacy-utility curves); 0 = none; must be 0 with "
                       "private tuning", low=0, high=100)
    front: str = _f("tied", "each study's front for the after-search phase (re-runs, and the "
                            "audit with in_trial = false): 'tied' = the validation leader and "
                            "every trial tied with it within its 95% interval, 'best' = the "
                            "leader alone (one audit and one set of re-runs per study)",
                    choices=("tied", "best"))
    baseline: bool = _f(True, "also train and audit a non-private model with the same model and "
                              "data (a reference line on the report's curves)")
    baseline_lr: float = _f(3e-3, "Adam's learning rate for the non-private baseline (same "
                                  "epochs and batch size as the trials; on the demo's 140 steps "
                                  "1e-3 reached 0.81-0.83 validation accuracy, below the DP "
                                  "trials, 3e-3 0.92-0.93)", low=0.0, low_open=True, high=1.0,
                            log=True)
    pruner: str = _f("none", "stop weak trials early: 'asha' = asynchronous successive "
                             "halving on validation accuracy at epoch rungs (pruned trials are "
                             "recorded, never on a front; adaptive tuning only); 'none' = every "
                             "trial runs all epochs", choices=("none", "asha"))
    pruner_min_epochs: int = _f(1, "the pruner's first rung (epochs every trial runs)", low=1,
                                high=10000)
    pruner_factor: int = _f(3, "the pruner's reduction factor eta: rungs at min_epochs x "
                               "eta^k, a trial continues if in the top 1/eta at its rung",
                            low=2, high=100)
    tuning: str = _f("adaptive", "'adaptive': the sampler explores, selection over private "
                                 "validation metrics is not covered by epsilon; 'private': random "
                                 "search with a random number of trials and a noisy validation "
                                 "score, privacy.epsilon is then the end-to-end target of the "
                                 "released model (Papernot & Steinke 2022); it admits nothing "
                                 "adaptive: sweep.seeds = 0, audit.in_trial = false",
                     choices=("adaptive", "private"))
    expected_trials: float = _f(10.0, "private tuning: mean number of trials", low=1.0,
                                high=10000.0)
    trial_count_distribution: str = _f("poisson", "private tuning: law of the number of trials",
                                       choices=("poisson", "truncated_negative_binomial"))
    trial_count_shape: float = _f(1.0, "private tuning: shape eta of the truncated negative "
                                       "binomial (1 = geometric)", low=0.0, high=100.0)
    score_noise: float = _f(20.0, "private tuning: noise multiplier of the validation score "
                                  "(std of the Gaussian added to the count of correct "
                                  "predictions)", low=0.0, low_open=True, high=1e6)


@dataclass(frozen=True)
class AuditConfig:
    enabled: bool = _f(True, "attack every trained model with calibrated per-layer membership "
                             "attacks (LiRA, RMIA, loss threshold, shadow classifier)")
    in_trial: bool = _f(True, "audit inside each trial (two-objective search: validation "
                              "accuracy up, peak MIA down); false = accuracy-only search, the "
                              "fronts (with private tuning: the released trial) audited after "
                              "the sweep; must be false with private tuning")
    references: str = _f("online", "reference models: 'online' (trained on halves of the "
                                   "audited members and non-members; each candidate is IN for "
                                   "half of them: the stronger plan) or 'offline' (trained on "
                                   "the public shadow pool only)",
                         choices=("offline", "online"))
    reference_models: int = _f(4, "reference models per audited trial (each trains like the "
                                  "trial; the audit's main cost)", low=4, high=256)
    share_references: str = _f("study", "'study': after the sweep, score each trial's audit "
                                        "with the references of every audited trial of its "
                                        "study (each trains its own on independent halves: T "
                                        "trials give T x reference_models, no extra training); "
                                        "'none': each trial's references alone",
                               choices=("study", "none"))
    max_candidates: int = _f(0, "audited members (and as many non-members) per trial; 0 = "
                                "min(train_size, holdout_size)", low=0)
    alpha: float = _f(0.05, "significance level of leak_detected (Holm-corrected over layers "
                            "and attacks) and of the simultaneous upper bound pick constrains",
                      low=0.0, low_open=True, high=0.5)
    scope: str = _f("front", "with in_trial = false: audit the 'front' trials of each study "
                             "after the sweep, or 'all' finished trials",
                    choices=("front", "all"))
    seed: int = _f(0, "seed of the audited candidates, reference training sets and seeds",
                   low=0, high=MAX_SEED, allowed_text=f"an integer in [0, {MAX_SEED}]")
    layer_probes: bool = _f(True, "also attack each layer's representation: the loss of a "
                                  "linear probe fitted per model on validation examples no "
                                  "model trained on (leakage that grows with depth; costs a "
                                  "probe fit per model and layer)")


@dataclass(frozen=True)
class TrackingConfig:
    tensorboard: bool = _f(True, "write each trial's per-epoch and final values as TensorBoard "
                                 "event files under RUN_DIR/tensorboard/ (`tensorboard --logdir "
                                 "RUN_DIR`)")
    mlflow_uri: str = _f("", "MLflow tracking URI (a server, or sqlite:///path/mlflow.db): one "
                             "MLflow run per trial with its parameters, values and privacy "
                             f"statement; '' = none; needs `{MLFLOW_EXTRA}`")


SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "privacy": PrivacyConfig,
                             "budget": BudgetConfig, "training": TrainingConfig,
                             "resources": ResourcesConfig, "sweep": SweepConfig,
                             "audit": AuditConfig, "tracking": TrackingConfig}


@dataclass(frozen=True)
class Config:
    """A parsed config: plain values, each field checked, nothing resolved, so it can be
    copied, compared and written back as it was read. The rules across fields, and what it
    means for its data, model and methods, are a :class:`orchestrator.door.CheckedSetup`, which
    every command makes through ``orchestrator.door.check``."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    #: Method hyperparameters: flat keys for every method declaring them, and per-method tables.
    method_params: dict[str, Any] = field(default_factory=dict)
    #: Search-range overrides per method: ``{method: {param: {low, high, log} | {choices}}}``.
    search: dict[str, Any] = field(default_factory=dict)

    def targets(self) -> list[float]:
        """The target epsilons trained at: ``budget.epsilons``, or ``[privacy.epsilon]``."""
        return list(self.budget.epsilons) or [self.privacy.epsilon]

    def one_target(self, *, command: str) -> Config:
        """This config at its only target: a command that trains one model at one epsilon
        refuses several rather than pick one (``privacy.epsilon`` is not read when
        ``budget.epsilons`` is set)."""
        targets = self.targets()
        if len(targets) > 1:
            raise UserInputError(field="budget.epsilons", value=targets,
                                 allowed=f"one target for {command} (it trains one model at "
                                         "one epsilon; `dpsweep run` sweeps several)")
        return dataclasses.replace(self, privacy=dataclasses.replace(self.privacy,
                                                                     epsilon=targets[0]))

    @property
    def user_data(self) -> bool:
        return self.data.dataset == FILE_DATASET

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("method_params", "search"):
            if not d[key]:
                del d[key]
        return d

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


def _section(section: str, raw: Any) -> Any:
    cls = SECTIONS[section]
    if not isinstance(raw, dict):
        raise UserInputError(field=section, value=raw, allowed="a table of keys")
    known = {f.name: f for f in fields(cls)}
    for key in raw:
        if key not in known:
            raise UserInputError(field=f"{section}.{key}", value=raw[key],
                                 allowed=f"one of the keys {sorted(known)} (unknown key)")
    return cls(**{k: field_param(section, known[k]).check(v, prefix=section)
                  for k, v in raw.items()})


def parse(raw: Mapping[str, Any], *, base_dir: str | Path | None = None) -> Config:
    """A config from parsed TOML, each field checked on its own; relative paths (data files,
    the code folder) resolved against ``base_dir`` (default: the working directory). The rules
    across fields and against the methods, data, model and machine are ``orchestrator.door``'s;
    parsing runs no code a config names."""
    raw = dict(raw)
    check_plain(raw, where="")
    method_params = raw.pop("method_params", {})
    search = raw.pop("search", {})
    for key, value in (("method_params", method_params), ("search", search)):
        if not isinstance(value, dict):
            raise UserInputError(field=key, value=value, allowed="a table")
    for key in raw:
        if key not in SECTIONS:
            raise UserInputError(field=key, value=raw[key] if not isinstance(raw[key], dict)
                                 else "[table]",
                                 allowed=f"one of the sections "
                                         f"{sorted([*SECTIONS, 'method_params', 'search'])} "
                                         "(unknown section)")
    cfg = Config(**{k: _section(k, v) for k, v in raw.items()}, method_params=method_params,
                 search=search)
    return resolve_paths(cfg, Path.cwd() if base_dir is None else Path(base_dir))


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed TOML of a config file, not yet validated (its path's form checked first, as
    the command line checks CONFIG)."""
    p = check_path_form(path, field="CONFIG", creates=False)
    try:
        if not p.is_file():
            raise UserInputError(field="CONFIG", value=str(p), allowed="an existing TOML file")
        text = p.read_text()
    except OSError as exc:  # a name too long, a folder that cannot be read
        raise UserInputError(field="CONFIG", value=str(p),
                             allowed=f"a readable TOML file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise UserInputError(field="CONFIG", value=str(p), allowed=f"valid TOML ({exc})") from None
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        # ValueError: an integer of more than 4,300 digits, which Python will not convert
        raise UserInputError(field="CONFIG", value=str(p), allowed=f"valid TOML ({exc})") from None


def parse_file(path: str | Path) -> Config:
    """A config parsed from a TOML file (:func:`parse`); relative paths are its folder's."""
    return parse(read_toml(path), base_dir=Path(path).resolve().parent)


def describe() -> str:
    """The documented defaults as a commented TOML file (``dpsweep config``)."""
    lines = ["# dpsweep config: every key with its default. Unknown keys are an error.",
             "# [method_params]: method hyperparameters (lr, clip_norm, ...); flat keys apply to",
             "# every method declaring them, [method_params.<method>] to one method. See",
             "# `dpsweep config --method M` for a method's table.", ""]
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        for f in fields(cls):
            p = field_param(section, f)
            if isinstance(p.default, list):
                value = "[" + ", ".join(f'"{v}"' for v in p.default) + "]"
            elif isinstance(p.default, dict):
                value = "{}"
            else:
                value = tomli_w.dumps({"x": p.default}).split("=", 1)[1].strip()
            lines.append(f"{f.name} = {value:<12} # {p.doc} ({p.allowed()})")
        lines.append("")
    return "\n".join(lines)
