"""What a config means once its data, model and methods are looked at: the resolved setup.

A :class:`~orchestrator.config.Config` holds plain values. Everything that needs the method
registry, a user's files or a built network (split sizes with their defaults, the model and data
sources, the trained layer count, the class count, the fingerprints of a user's code and data)
is resolved here and memoised on the :class:`ResolvedSetup`: a user's network is built and
checked at most once per setup, a user's data read at most once.

A command resolves its config once, where it starts, through ``orchestrator.door.check``,
which checks every rule on this setup and returns it as a ``CheckedSetup``: the one value that
everything planning or recording trials accepts. The config itself stays a plain value, and
``orchestrator.config`` imports nothing from here. Ray workers never receive a setup: they get
a :class:`core.trial.TrialSpec`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpsweep.core.datasets import FILE_DATASET, INPUT_SHAPES, NUM_CLASSES
from dpsweep.core.errors import UserInputError
from dpsweep.core.modes import INVALID_TAG
from dpsweep.core.vocabulary import SPLIT_NAMES
from dpsweep.trainables.data.files import FileSource
from dpsweep.trainables.data.splits import (
    DEFAULT_SIZES,
    DataSplits,
    SplitSizes,
    available_size,
    check_available,
    default_file_sizes,
    load_pool,
    load_splits,
)
from dpsweep.trainables.methods import METHODS, get_method, parse_series
from dpsweep.trainables.models.catalog import check_input_shape, layer_count, model_for
from dpsweep.trainables.models.source import ModelSource
from dpsweep.trainables.models.trainable import trainable_layers
from dpsweep.trainables.models.usercode import tree_sha256

if TYPE_CHECKING:
    from dpsweep.orchestrator.config import Config
    from dpsweep.trainables.models.networks import LayeredModel



@dataclass(frozen=True, eq=False)
class ResolvedSetup:
    """One config's data, model and sizes, each looked up once (``functools.cached_property``)."""

    config: Config

    # ---- the methods: series, parameters, and the checks against their declarations -------
    def series(self) -> list[tuple[str, str]]:
        """The sweep's (method, mode) series, in order: ``sweep.methods``, or every registered
        method this model can train, in its default mode (:attr:`left_out` says which not)."""
        names = self.config.sweep.methods or [n for n in METHODS if n not in self.left_out]
        return [parse_series(n) for n in names]

    @functools.cached_property
    def left_out(self) -> dict[str, str]:
        """The registered methods a sweep that names none leaves out, each with why: it needs
        more trained layers than this model has (a frozen backbone's head: one)."""
        if self.config.sweep.methods:
            return {}
        layers = self.num_layers
        return {name: f"needs at least {cls.min_trained_layers} trained layers, the model has "
                      f"{layers}" for name, cls in METHODS.items()
                if cls.min_trained_layers > layers}

    def left_out_line(self) -> str:
        """One line on :attr:`left_out` for ``config --check`` and ``run`` ("" when none)."""
        if not self.left_out:
            return ""
        return "sweep.methods is empty, so every method this model can train: " + "; ".join(
            f"{name} left out ({why})" for name, why in self.left_out.items())

    def given_params(self, method: str) -> dict[str, Any]:
        """What the config sets for ``method``: flat keys it declares, then its own table."""
        params = self.config.method_params
        declared = get_method(method).declaration()
        flat = {k: v for k, v in params.items() if not isinstance(v, dict) and k in declared}
        return {**flat, **params.get(method, {})}

    def trial_params(self, method: str | None = None, *, mode: str | None = None,
                     preset: str | None = None) -> dict[str, Any]:
        """The validated method parameters of one trial: the preset (``training.preset`` for the
        single-trial method), then the config's values, then ``mode`` if given."""
        training = self.config.training
        name = method or training.method
        cls = get_method(name)
        chosen = training.preset if preset is None and name == training.method \
            else (preset or "")
        values = dict(cls.presets()[chosen]) if chosen else {}
        values.update(self.given_params(name))
        if mode is not None:
            values["mode"] = mode
        return cls.validate_params(values)

    # ---- the data and the model ---------------------------------------------------------------
    @functools.cached_property
    def model_source(self) -> ModelSource:
        """The network every trial of this config trains (``trainables.models.source``)."""
        m = self.config.model
        return ModelSource(name=m.name, activation=m.activation, factory=m.factory,
                           args=m.args, layers=tuple(m.layers), code_dir=m.code_dir, fix=m.fix)

    @functools.cached_property
    def file_source(self) -> FileSource | None:
        """The user's data (``dataset = 'file'``), else None; built (and so checked) once."""
        if not self.config.user_data:
            return None
        d, code_dir = self.config.data, self.config.model.code_dir
        return FileSource(path=d.path, factory=d.factory, code_dir=code_dir,
                          label_column=d.label_column, feature_columns=tuple(d.feature_columns),
                          split_column=d.split_column, public_path=d.public_path,
                          mean=tuple(d.mean), std=tuple(d.std), num_classes=d.num_classes,
                          inputs=d.inputs)

    @functools.cached_property
    def _available(self) -> Any:
        """What a user's data can serve (rows, public rows, an assigned split)."""
        return available_size(FILE_DATASET, source=self.file_source)

    @functools.cached_property
    def split_sizes(self) -> dict[str, int]:
        """Split sizes with the dataset's defaults filled in (a user's data: its own split
        column's counts, else shares of its rows)."""
        cfg = self.config
        if cfg.user_data:
            avail = self._available
            d = avail.assigned if avail.assigned is not None else default_file_sizes(
                avail.pool, has_public=avail.public is not None, public_n=avail.public or 0)
        else:
            d = DEFAULT_SIZES[cfg.data.dataset]
        return {name: getattr(cfg.data, f"{name}_size") or getattr(d, name)
                for name in SPLIT_NAMES}

    def file_pool(self, sizes: dict[str, int]) -> int:
        """Rows a user's data offers for ``sizes`` (the pool check counts against them); sizes it
        cannot serve are refused by name."""
        avail = self._available
        if avail.assigned is not None:
            for name, count in vars(avail.assigned).items():
                if sizes[name] != count:
                    raise UserInputError(field=f"data.{name}_size", value=sizes[name],
                                         allowed=f"0 or {count} (the split column assigns "
                                                 f"{count})")
            return sum(sizes.values())
        if avail.public is not None:
            if sizes["shadow"] > avail.public:
                raise UserInputError(field="data.shadow_size", value=sizes["shadow"],
                                     allowed=f"<= {avail.public} (rows of data.public_path)")
            return avail.pool + sizes["shadow"]
        return avail.pool

    @functools.cached_property
    def num_layers(self) -> int:
        """How many layers DP training trains (``trainables.models.networks.TrainableLayers``: a
        frozen layer is none, a trainable parameter of a parent is one); a user's network is
        built and checked (``trainables.models.validator``) the first time this is read."""
        cfg = self.config
        if not cfg.model.factory and not cfg.user_data:
            name = model_for(model=cfg.model.name, dataset=cfg.data.dataset)
            check_input_shape(model=name, input_shape=INPUT_SHAPES[cfg.data.dataset])
            return layer_count(model=name, dataset=cfg.data.dataset)
        return len(trainable_layers(self.build_network()).layer_names)

    @functools.cached_property
    def num_classes(self) -> int:
        """Classes of the config's data (a user's data is read for it)."""
        if not self.config.user_data:
            return NUM_CLASSES[self.config.data.dataset]
        return load_pool(dataset=FILE_DATASET, source=self.file_source).num_classes

    def data_splits(self) -> DataSplits:
        """The config's splits (the pool is cached in-process); bad data raise UserInputError."""
        d = self.config.data
        return load_splits(dataset=d.dataset, seed=d.split_seed,
                           sizes=SplitSizes(**self.split_sizes),
                           data_dir=d.data_dir or None, source=self.file_source)

    def build_network(self, data: DataSplits | None = None) -> LayeredModel:
        """A fresh network of the config's architecture for its data (seed torch first): a
        user's is checked on two real public examples (the shadow split's)."""
        # the builders need torch; validating a config resolves a setup without building
        from dpsweep.trainables.models import assemble

        source, dataset = self.model_source, self.config.data.dataset
        if self.config.user_data or data is not None:
            data = self.data_splits() if data is None else data
            return assemble.build_network(source, input_shape=data.input_shape,
                                          num_classes=data.num_classes, dataset=data.name,
                                          sample=data.shadow.x[:2])
        return assemble.build_network(source, input_shape=INPUT_SHAPES[dataset],
                                      num_classes=NUM_CLASSES[dataset], dataset=dataset)

    @functools.cached_property
    def data_location(self) -> str:
        """Where the config's data is found, without downloading (the door refuses data that
        is not there; ``dpsweep config --check`` prints it); a user's data is read and checked
        in full, once."""
        d = self.config.data
        return check_available(dataset=d.dataset, data_dir=d.data_dir or None,
                               source=self.file_source)

    def input_fingerprints(self) -> dict[str, str]:
        """SHA-256 of the user's model code and data files (empty for built-ins only)."""
        cfg = self.config
        out: dict[str, str] = {}
        if cfg.model.factory or cfg.data.factory:
            out.update(self.model_source.fingerprint())
            if not out and cfg.model.code_dir:
                out["model_code"] = tree_sha256(cfg.model.code_dir)
        if self.file_source is not None:
            out.update(self.file_source.fingerprint())
        return out

    def fixed_keys(self, method: str) -> dict[str, tuple[str, Any]]:
        """The hyperparameters ``[method_params]`` fixes for ``method``: name -> (key, value)."""
        params = self.config.method_params
        declared = get_method(method).declaration()
        out = {k: (f"method_params.{k}", v) for k, v in params.items()
               if not isinstance(v, dict) and k in declared}
        own = params.get(method)
        if isinstance(own, dict):
            out.update({k: (f"method_params.{method}.{k}", v) for k, v in own.items()})
        return out


def describe_method(method: str) -> str:
    """One method's hyperparameter table, from its declaration (``dpsweep config --method``)."""
    cls = get_method(method)
    rows = cls.declaration().table()
    modes = "; ".join(f"{m.name} ({'valid' if m.dp_valid else INVALID_TAG})" for m in cls.modes)
    out = [f"{cls.name}: {cls.summary}", f"  source: {cls.citation or 'baseline'}",
           f"  modes: {modes}", ""]
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        extra = [x for x in (r["log"], f"modes: {r['modes']}" if r["modes"] != "all" else "",
                             f"presets: {r['presets']}" if r["presets"] else "") if x]
        out.append(f"  {r['name']:<{width}}  default {r['default']:<10} {r['allowed']}")
        out.append(f"  {'':<{width}}  {r['doc']}" + (f" [{'; '.join(extra)}]" if extra else ""))
    return "\n".join(out)
