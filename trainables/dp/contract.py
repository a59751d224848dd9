"""The method contract: what a DP method declares once, as class attributes, and what is
derived from it (``docs/design.md``, "The method contract").

A method declares its hyperparameters (:class:`core.params.ParamSet`, with bounds, defaults,
search scale, paper presets and the modes that read each one), its modes
(:class:`core.modes.Mode`: for each statistic it computes, where the statistic comes from), and
its privacy argument. Config validation, the search space's encoding (``search_spaces``), the
trial spec, ``dpsweep config --method``, the README tables, ``dp_valid`` and its reason all
derive from that declaration. It is kept apart from the step itself
(:class:`trainables.dp.step.DPStep`) so the declaration can be read, and a search space can
name a method's parameters, without anything of the step's arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from dpsweep.core.errors import UserInputError
from dpsweep.core.modes import Mode
from dpsweep.core.params import Param, ParamSet, ValidatedParams
from dpsweep.core.schedule import Schedule
from dpsweep.reports.series import LoggedSeries

# ---- hyperparameters every SGD-family method shares -------------------------------------------
LR = Param("lr", 0.5, "learning rate", low=0.0, low_open=True, high=100.0, log=True)
CLIP = Param("clip_norm", 1.0, "per-example clipping norm C (sensitivity of the summed "
             "gradient)", low=0.0, low_open=True, high=1e4, log=True)
MOMENTUM = Param("momentum", 0.0, "SGD momentum", low=0.0, high=1.0, high_open=True,
                 role="setting")
#: The standard mode of a method whose statistics all come from fixed or released values.
STANDARD = Mode("standard", doc="the method as published; no data-dependent statistic")

#: A public refresh left to its default period processes at most this many public examples per
#: private example of the steps it serves, so it costs a bounded share of the step at any batch
#: size. A fixed period does not: 64 public examples every 4 steps added 12-16% to a batch-128
#: ResNet20-GN step (bench/step_time.py) and would add twice that at batch 64.
PUBLIC_SHARE = 0.05


def public_every(name: str, *, what: str) -> Param:
    """The period of a method's refresh from public data (steps; none = derived from the
    batch by ``DPStep.refresh_period``). Declared here so every method derives it one way."""
    return Param(name, None, f"steps between refreshes of {what} from a public batch; none: "
                 f"the fewest that keep public examples <= {PUBLIC_SHARE:g} x the private ones "
                 f"(ceil(public_batch_size / ({PUBLIC_SHARE:g} x expected batch)); 10 at "
                 "batch 128)",
                 kind="int", nullable=True, low=1, modes=("public",), role="setting")


class MethodContract:
    """The class-level declaration every DP method makes, and what is derived from it."""

    name: ClassVar[str] = "base"
    #: One line for tables: what the method does.
    summary: ClassVar[str] = ""
    #: The paper the method comes from, by title and arXiv id ("" for the baseline).
    citation: ClassVar[str] = ""
    #: Why the epsilon claim holds in the sound modes (the validity reason's first sentence).
    argument: ClassVar[str] = ("each example's gradient is clipped to L2 norm <= C and "
                               "N(0, sigma^2 C^2) is added once per Poisson batch: the "
                               "Poisson-subsampled Gaussian mechanism, composed by the accountant.")
    modes: ClassVar[tuple[Mode, ...]] = (STANDARD,)
    params: ClassVar[ParamSet] = ParamSet.of(LR, CLIP, MOMENTUM)
    #: Optimiser the method's update rule uses.
    optimizer_name: ClassVar[str] = "sgd"
    #: Hyperparameters that compress every state change of the method (controller updates,
    #: freezing, refreshes) into a few dozen steps, for the lifecycle conformance suite.
    fast_lifecycle: ClassVar[dict[str, Any]] = {}
    #: Fewest trained layers the method can work with (a model with fewer is refused for it
    #: at config validation, where the config names the method).
    min_trained_layers: ClassVar[int] = 1
    #: The per-step series ``trajectories()`` logs, as the report shows them (None: it logs
    #: none); the report knows no method by name.
    report_series: ClassVar[LoggedSeries | None] = None

    # ---- derived from the declaration --------------------------------------------------------
    @classmethod
    def declaration(cls) -> ParamSet:
        """Every parameter of the method: ``mode`` (from ``modes``) first, then ``params``."""
        names = tuple(m.name for m in cls.modes)
        mode = Param("mode", names[0], "where the method's statistics come from (its modes)",
                     choices=names, role="setting")
        return ParamSet((mode, *cls.params.params), cls.params.constraints)

    @classmethod
    def validate_params(cls, params: Mapping[str, Any]) -> ValidatedParams:
        """Defaults filled, every value checked against its declaration (one message format).

        Values this method validated already pass through unchanged: each layer may call this
        on what it is handed, and the check itself runs once where the values came in.
        """
        if isinstance(params, ValidatedParams) and params.owner == cls.name:
            return params
        return ValidatedParams(cls.declaration().validate(
            params, prefix="method_params", mode_param="mode"), owner=cls.name)

    @classmethod
    def presets(cls) -> dict[str, dict[str, Any]]:
        """Named presets (``paper`` = the paper's defaults), from the declarations."""
        decl = cls.declaration()
        return {name: decl.preset(name) for name in decl.preset_names()}

    @classmethod
    def mode_named(cls, name: str) -> Mode:
        for m in cls.modes:
            if m.name == name:
                return m
        raise UserInputError(field="method_params.mode", value=name,
                             allowed=f"a mode of {cls.name}: {[m.name for m in cls.modes]}")

    @classmethod
    def check_setting(cls, params: Mapping[str, Any], *, num_layers: int,
                      sizes: Mapping[str, int]) -> None:
        """Refuse hyperparameters that cannot work with this model and these splits, at config
        validation (before anything is written); default: every declared value works."""
        del params, num_layers, sizes

    @classmethod
    def noise_shape(cls, *, epochs: int, steps_per_epoch: int,
                    params: Mapping[str, Any]) -> Schedule:
        """Relative noise schedule the accountant scales to the budget (default: constant)."""
        del params
        return Schedule.constant(noise_multiplier=1.0, steps=epochs * steps_per_epoch)

    @classmethod
    def prepare(cls, *, data: Any, model_factory: Any, params: Mapping[str, Any], seed: int,
                cache_dir: Any) -> dict[str, Any]:
        """Once-per-sweep work on public data only (e.g. a risk vector); returns params to add.

        ``model_factory()`` builds a fresh model of the trial's architecture. The result must be
        plain data (it travels in every trial's spec) and be cached in ``cache_dir``.
        """
        del data, model_factory, params, seed, cache_dir
        return {}
