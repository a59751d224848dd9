"""From a validated config to one trial's spec, and back: the budget is matched here, not in
the trial.

Keeping calibration in the orchestrator means a sweep asks the accountant once per distinct
question (cached on disk) and every trial receives the exact schedule it must train with.
:func:`config_from_spec` is :func:`plan_trial`'s inverse (what ``dpsweep pick`` writes to
retrain a trial); the two live side by side so a field added to one is seen in the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpsweep.core.errors import UserInputError
from dpsweep.core.poisson import PHYSICAL_BATCH, poisson_plan
from dpsweep.core.trial import Calibration, TrialSpec
from dpsweep.core.vocabulary import SPLIT_NAMES
from dpsweep.orchestrator.accounting.cache import default_cache_dir
from dpsweep.orchestrator.accounting.calibration import calibrate, epsilon_curve
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.door import CheckedSetup, check_dict, require_checked
from dpsweep.trainables.data.splits import DataSplits, load_pool
from dpsweep.trainables.methods import METHODS, get_method, series_name


def data_pool(setup: CheckedSetup) -> dict[str, Any]:
    """The config's raw pool as workers receive it (Ray's object store: read once by the driver,
    mapped once per node) for ``orchestrator.trial.runner.use_data_pool``."""
    cfg = setup.config
    data_dir = cfg.data.data_dir or None
    source = setup.file_source
    return {"pool": load_pool(dataset=cfg.data.dataset, data_dir=data_dir, source=source),
            "dataset": cfg.data.dataset, "data_dir": data_dir,
            "source": None if source is None else source.to_dict()}


def match_budget(*, method: str, params: dict, dataset_size: int, batch_size: int,
                 epochs: int, epsilon: float, delta: float, cache_dir: Path | None,
                 timeout_s: float) -> tuple[Calibration, list[float]]:
    """The calibrated schedule for a training run and its upper epsilon after each epoch.

    The sample rate is the loader's exact 1/ceil(N/B); the method's noise shape (constant, or
    AdamILG's epoch decay) is scaled to the target. Shadow models of the audit use this too,
    with their own N, so they spend the same (epsilon, delta) as the target.
    """
    q, steps_per_epoch = poisson_plan(dataset_size=dataset_size, batch_size=batch_size)
    shape = get_method(method).noise_shape(epochs=epochs, steps_per_epoch=steps_per_epoch,
                                           params=params)
    cal = calibrate(target_epsilon=epsilon, delta=delta, sample_rate=q, shape=shape,
                    cache_dir=cache_dir, timeout_s=timeout_s)
    curve = epsilon_curve(cal, at_steps=[steps_per_epoch * (e + 1) for e in range(epochs)])
    return cal, [b.upper for b in curve]


def plan_trial(setup: CheckedSetup, *, method: str | None = None,
               params: Mapping[str, Any] | None = None, epsilon: float | None = None,
               trial_id: str = "trial", cache_dir: Path | None = None,
               data: DataSplits | None = None,
               calibration: Calibration | None = None) -> TrialSpec:
    """Match the budget for the config's sampling plan and method schedule; return the spec.

    ``setup`` is the config resolved once by the command that plans (its sizes, model and data
    sources are looked up once for every trial it plans). ``epsilon`` is the target the trial
    is held to (one of ``Config.targets``; by default ``privacy.epsilon``): a sweep passes each
    study's target here rather than a copy of the config per target.
    ``params`` are the trial's method parameters (validated here); by default the config's
    (``CheckedSetup.trial_params``). ``calibration`` replaces budget matching with a certified
    schedule (private tuning). Runs the method's once-per-sweep preparation (on public data
    only, cached) first, since its output (e.g. LM-DP-SGD's risk vector) travels in the spec.
    """
    cfg = require_checked(setup, where="plan_trial").config
    name = method or cfg.training.method
    method_cls = get_method(name)
    params = method_cls.validate_params(setup.trial_params(name) if params is None else params)
    sizes = dict(setup.split_sizes)
    epochs = cfg.training.epochs
    if calibration is None:
        cal, curve = match_budget(method=name, params=params, dataset_size=sizes["train"],
                                  batch_size=cfg.training.batch_size, epochs=epochs,
                                  epsilon=cfg.privacy.epsilon if epsilon is None else epsilon,
                                  delta=cfg.privacy.delta,
                                  cache_dir=cache_dir,
                                  timeout_s=cfg.privacy.accountant_timeout_s)
    else:  # a schedule fixed elsewhere (private tuning): certified, not searched
        _, steps_per_epoch = poisson_plan(dataset_size=sizes["train"],
                                          batch_size=cfg.training.batch_size)
        cal = calibration
        curve = [b.upper for b in epsilon_curve(
            cal, at_steps=[steps_per_epoch * (e + 1) for e in range(epochs)])]
    prepared = method_cls.prepare(
        data=data if data is not None else _lazy_data(setup),
        model_factory=setup.build_network,
        params=params, seed=cfg.training.seed, cache_dir=cache_dir or default_cache_dir())
    if prepared:  # new values (computed, or read from the preparation cache): checked once
        params = method_cls.validate_params({**params, **prepared})
    source = setup.file_source
    return TrialSpec(
        method=name,
        method_params=params,
        epochs=epochs,
        batch_size=cfg.training.batch_size,
        calibration=cal,
        epsilon_curve=curve,
        seed=cfg.training.seed,
        randomness=randomness_kind(cfg),
        dataset=cfg.data.dataset,
        data_dir=cfg.data.data_dir or None,
        split_seed=cfg.data.split_seed,
        sizes=sizes,
        model=cfg.model.name,
        activation=cfg.model.activation,
        user_model=setup.model_source.to_dict() if cfg.model.factory else None,
        data_source=None if source is None else source.to_dict(),
        device=cfg.resources.device,
        threads=cfg.resources.cpus_per_trial,
        max_physical_batch=cfg.training.max_physical_batch,
        trial_id=trial_id,
        gpu_share=gpu_share(cfg.resources.gpus_per_trial),
    )


def gpu_share(gpus_per_trial: float) -> float:
    """The fraction of one GPU a trial may fill (``TrialSpec.gpu_share``): what Ray gives it,
    at most a whole one (a multi-GPU trial trains on one); 1 without GPUs (unused there)."""
    return min(1.0, float(gpus_per_trial)) if gpus_per_trial > 0 else 1.0


def randomness_kind(cfg: Config) -> str:
    """Where a trial's noise and sampling come from (``trainables.dp.randomness``)."""
    if cfg.training.reproducible:
        return "reproducible"
    return "secure" if cfg.training.secure_mode else "secret"


def config_from_spec(spec: Mapping[str, Any]) -> Config:
    """A full, validated config that retrains the trial described by ``spec``.

    Method hyperparameters (lr, clip_norm, momentum, mode, ...) go to ``[method_params]``, only
    those the method declares and not its prepared ones (``ParamSet.prepared``: LM-DP-SGD's
    risk vector), which a rerun recomputes. The preset is resolved already (its values are in
    the spec), so it is left empty; the randomness kind maps back onto ``reproducible`` and
    ``secure_mode``.
    """
    method = str(spec.get("method"))
    cls = METHODS.get(method)
    if cls is None:
        raise UserInputError(field="spec.method", value=method,
                             allowed=f"a registered method: {sorted(METHODS)}")
    declared = cls.declaration()
    params = {k: v for k, v in (spec.get("method_params") or {}).items()
              if k in declared and k not in declared.prepared()}
    sizes = spec.get("sizes") or {}
    cal = Calibration.from_dict(spec["calibration"])
    device = str(spec.get("device", "auto"))
    randomness = str(spec.get("randomness", "secret"))
    mode = str(params.get("mode", cls.modes[0].name))
    raw = {
        "data": {"dataset": spec["dataset"], "data_dir": spec.get("data_dir") or "",
                 "split_seed": int(spec.get("split_seed", 0)),
                 **{f"{name}_size": int(sizes.get(name, 0))
                    for name in SPLIT_NAMES}},
        "model": {"name": spec.get("model", "auto"), "activation": spec.get("activation", "tanh")},
        "privacy": {"epsilon": cal.target_epsilon, "delta": cal.delta},
        "training": {"method": method, "preset": "", "batch_size": int(spec["batch_size"]),
                     "epochs": int(spec["epochs"]),
                     "max_physical_batch": int(spec.get("max_physical_batch", PHYSICAL_BATCH)),
                     "seed": int(spec.get("seed", 0)),
                     "reproducible": randomness == "reproducible",
                     "secure_mode": randomness == "secure"},
        "resources": {"cpus_per_trial": int(spec.get("threads", 1)),
                      "gpus_per_trial": 1.0 if device == "cuda" else 0.0, "device": device},
        # a sweep of this series alone; `dpsweep train` on this config retrains the trial
        "sweep": {"methods": [series_name(method, mode)], "trials_per_method": 1},
        "method_params": params,
    }
    user_model, data_source = spec.get("user_model"), spec.get("data_source")
    if user_model:  # ModelSource.to_dict(): the [model] keys of the same names
        raw["model"].update({k: user_model[k] for k in ("factory", "args", "layers",
                                                         "code_dir")})
        if "fix" in user_model:  # written only when set
            raw["model"]["fix"] = user_model["fix"]
    if data_source:  # FileSource.to_dict(): [data] keys, and the code folder of its factory
        raw["data"].update({k: v for k, v in data_source.items() if k != "code_dir"})
        raw["model"]["code_dir"] = raw["model"].get("code_dir") or data_source["code_dir"]
    return check_dict(raw, machine=False).config


class _lazy_data:
    """Loads the splits only if a method's preparation actually reads them."""

    def __init__(self, setup: CheckedSetup) -> None:
        self._setup = setup
        self._data: DataSplits | None = None

    def __getattr__(self, name: str) -> object:
        if self._data is None:
            self._data = self._setup.data_splits()
        return getattr(self._data, name)
