"""The one door: parse -> resolve and check -> plan.

Every way in (each CLI verb, every ``api`` function, ``train``, ``resume``, ``reaudit``) turns
a config into a :class:`CheckedSetup` here, and only here: :func:`check` runs every rule that
looks across sections or at the method registry, the data, the model and this machine, in one
order, so a config with several faults is always refused for the same one first, with the same
line through the command line and through the API. ``run_sweep``, ``train_single`` and the
planners accept nothing else (:func:`require_checked`).

``orchestrator.config`` parses (each field on its own, paths made absolute) and imports nothing
from here; ``orchestrator.trial.setup`` resolves (what the config means, looked up once).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from dpsweep.core.datasets import FILE_DATASET
from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.cluster.resources import check_config_resources
from dpsweep.orchestrator.config import (
    MLFLOW_EXTRA,
    MLFLOW_MODULE,
    Config,
    DataConfig,
    parse,
    parse_file,
)
from dpsweep.orchestrator.config.checks import check_budget, check_sizes
from dpsweep.orchestrator.trial.setup import ResolvedSetup
from dpsweep.search_spaces import check_overrides
from dpsweep.trainables.methods import METHODS

#: Only :func:`check` holds it: a :class:`CheckedSetup` made anywhere else is refused.
_DOOR = object()
#: ``[data]`` keys that describe a user's data: set with a built-in dataset they would be
#: ignored, so they are refused.
FILE_KEYS = ("path", "factory", "feature_columns", "split_column", "public_path", "mean", "std",
             "num_classes", "inputs")


@dataclass(frozen=True, eq=False)
class CheckedSetup(ResolvedSetup):
    """A :class:`ResolvedSetup` whose config met every rule; made only by :func:`check`."""

    door: InitVar[object] = None

    def __post_init__(self, door: object) -> None:
        if door is not _DOOR:
            raise TypeError("a CheckedSetup comes only from orchestrator.door.check(cfg)")


def check(cfg: Config, *, machine: bool = True, data: bool = False) -> CheckedSetup:
    """``cfg`` through every cross-field and model-dependent rule; ``machine``: its resources
    against this machine too (a sweep on a cluster checks them against the cluster's nodes once
    connected); ``data``: its data on this machine, without downloading (``config --check``
    and ``api.load_config``; a sweep's driver may download a torchvision dataset)."""
    if not isinstance(cfg, Config):
        raise UserInputError(field="cfg", value=type(cfg).__name__,
                             allowed="a Config (load_config, from_dict, or Config() changed "
                                     "with dataclasses.replace)")
    setup = CheckedSetup(config=cfg, door=_DOOR)
    check_methods(setup)
    _check_data_keys(setup)
    check_sizes(cfg, setup)
    check_budget(cfg, setup)
    if cfg.sweep.pruner != "none" and cfg.sweep.pruner_min_epochs >= cfg.training.epochs:
        raise UserInputError(field="sweep.pruner_min_epochs", value=cfg.sweep.pruner_min_epochs,
                             allowed=f"< training.epochs = {cfg.training.epochs} (the first "
                                     "rung must come before the last epoch)")
    check_settings(setup)
    _check_private(cfg)
    if cfg.tracking.mlflow_uri and find_spec(MLFLOW_MODULE) is None:
        raise UserInputError(field="tracking.mlflow_uri", value=cfg.tracking.mlflow_uri,
                             allowed=f"'' unless MLflow is installed ({MLFLOW_EXTRA})")
    if data:  # on this machine, or refused (nothing is downloaded here)
        _ = setup.data_location
    if machine:
        check_config_resources(cfg.resources, max_concurrent=cfg.sweep.max_concurrent_trials,
                               info=None)
    return setup


def check_file(path: str | Path, *, machine: bool = True, data: bool = False) -> CheckedSetup:
    """A TOML config file parsed (relative paths are its folder's) and checked."""
    return check(parse_file(path), machine=machine, data=data)


def check_dict(raw: Any, *, base_dir: str | Path | None = None, machine: bool = True,
               data: bool = False) -> CheckedSetup:
    """A config shaped like the TOML file parsed (relative paths against ``base_dir``, default
    the working directory) and checked."""
    return check(parse(raw, base_dir=base_dir), machine=machine, data=data)


def require_checked(setup: Any, *, where: str) -> CheckedSetup:
    """``setup`` if it came through :func:`check`; anything else is a programming error."""
    if not isinstance(setup, CheckedSetup):
        raise TypeError(f"{where} takes a CheckedSetup from orchestrator.door.check(cfg), "
                        f"not {type(setup).__name__}")
    return setup


# ---- the methods ----------------------------------------------------------------------------
def check_methods(setup: ResolvedSetup) -> None:
    """The single-trial method and its preset exist, the series are distinct, and every
    ``[method_params]`` key is declared by a method in play."""
    cfg = setup.config
    if cfg.training.method not in METHODS:
        raise UserInputError(field="training.method", value=cfg.training.method,
                             allowed=f"one of {sorted(METHODS)}")
    presets = METHODS[cfg.training.method].presets()
    if cfg.training.preset and cfg.training.preset not in presets:
        raise UserInputError(field="training.preset", value=cfg.training.preset,
                             allowed=f"'' or a preset of {cfg.training.method}: "
                                     f"{sorted(presets) or 'none'}")
    series = setup.series()
    if len(set(series)) != len(series):
        raise UserInputError(field="sweep.methods", value=cfg.sweep.methods,
                             allowed="distinct 'method' or 'method:mode' entries")
    _check_method_params(cfg, sorted({cfg.training.method, *(m for m, _ in series)}))


def _check_method_params(cfg: Config, methods: list[str]) -> None:
    """Every key is declared by some method in play; per-method tables name known methods."""
    for key, value in cfg.method_params.items():
        if isinstance(value, dict):
            if key not in METHODS:
                raise UserInputError(field=f"method_params.{key}", value="[table]",
                                     allowed=f"a table named after a method: {sorted(METHODS)}")
            continue
        if not any(key in METHODS[m].declaration() for m in methods):
            raise UserInputError(field=f"method_params.{key}", value=value,
                                 allowed=f"a hyperparameter declared by {', '.join(methods)} "
                                         "(see `dpsweep config --method M`)")


def check_settings(setup: ResolvedSetup) -> None:
    """Each trial's parameters fit its model and splits (``DPStep.check_setting``), every
    method in play has the trained layers it needs, and the ``[search]`` overrides fit the
    swept methods."""
    cfg = setup.config
    series = setup.series()
    layers, sizes = setup.num_layers, setup.split_sizes
    checks = [(cfg.training.method, setup.trial_params())]  # the single-trial method, too
    checks += [(method, setup.trial_params(method, mode=mode)) for method, mode in series]
    # the single-trial method and every series need enough trained layers (a sweep that names
    # no method has left out those this model cannot train: ResolvedSetup.left_out)
    for method, params in checks:
        need = METHODS[method].min_trained_layers
        if layers < need:
            raise UserInputError(
                field="method", value=method,
                allowed=f"a model with at least {need} trained layers ({method}: "
                        f"{METHODS[method].summary.split(' (')[0]}); this model has "
                        f"{layers}: choose another method")
        METHODS[method].check_setting(params, num_layers=layers, sizes=sizes)
    swept = sorted({m for m, _ in series})
    check_overrides(cfg.search, methods=[m for m, _ in series],
                    fixed={m: setup.fixed_keys(m) for m in swept},
                    modes={m: [mode for n, mode in series if n == m] for m in swept})


# ---- the data, and private tuning -----------------------------------------------------------
def _check_data_keys(setup: ResolvedSetup) -> None:
    cfg = setup.config
    if cfg.user_data:
        _ = setup.file_source  # validates every field of the user's data description
        if not cfg.model.factory and cfg.model.name == "auto":
            raise UserInputError(field="model.factory", value="",
                                 allowed="your model ('package.module:function') for dataset = "
                                         "'file', or a built-in [model] name that fits its inputs")
        return
    defaults = DataConfig()
    for key in FILE_KEYS:
        if getattr(cfg.data, key) != getattr(defaults, key):
            raise UserInputError(field=f"data.{key}", value=getattr(cfg.data, key),
                                 allowed=f"unset unless data.dataset = '{FILE_DATASET}'")
    _ = setup.model_source  # the factory reference, args and layers, checked


def _check_private(cfg: Config) -> None:
    """Private tuning admits nothing adaptive: Papernot & Steinke's bound counts K random trials
    and the release of the best noisy score, not extra trials chosen by noiseless metrics or a
    search that reads an attack on the training members."""
    if cfg.sweep.tuning != "private":
        return
    if len(cfg.budget.epsilons) > 1:
        raise UserInputError(field="budget.epsilons", value=cfg.budget.epsilons,
                             allowed="at most one target with sweep.tuning = 'private' (privacy."
                                     "epsilon is the end-to-end target of the one release)")
    if cfg.sweep.pruner != "none":
        raise UserInputError(field="sweep.pruner", value=cfg.sweep.pruner,
                             allowed="'none' with sweep.tuning = 'private' (stopping a trial "
                                     "on its validation accuracy is an adaptive choice the "
                                     "end-to-end bound does not count)")
    if cfg.sweep.seeds:
        raise UserInputError(field="sweep.seeds", value=cfg.sweep.seeds,
                             allowed="0 with sweep.tuning = 'private' (re-runs of trials chosen "
                                     "by noiseless validation accuracy are extra, adaptively "
                                     "chosen trials the end-to-end bound does not count)")
    if cfg.audit.enabled and cfg.audit.in_trial:
        raise UserInputError(field="audit.in_trial", value=True,
                             allowed="false (or audit.enabled = false) with sweep.tuning = "
                                     "'private': the audit then runs after the selection, on "
                                     "the released trial, outside the end-to-end bound")
