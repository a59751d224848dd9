"""One DP step with named phases, shared by every method, and the method contract.

Call order, once per Poisson batch (the training loop drives it through :meth:`DPStep.step`):

1. ``begin_step(step)``        adapt state, only from public data or released outputs
2. ``gradients(x, y)``         per-example gradient *view*: per-layer norms and weighted sums
3. ``clip(view)``              per-example clip / reweight, then sum; bounded by ``sensitivity``
4. ``noise(summed)``           Gaussian noise per layer with std ``noise_std()[layer]``
5. ``update(noisy)``           noisy sum / expected batch size into the optimizer
6. ``end_step(noisy)``         post-processing of the released noisy gradient

A method overrides only the phase it changes. The usual override is ``clip_coefficients``: a
[B, L] matrix of per-example, per-layer scale factors, so the clipped sum is one weighted sum
per layer (``view.weighted_sum``) and the sensitivity of every example can be checked from its
layer norms alone (the conformance suite does so with adversarial norms at every step of a
trial's lifecycle, see ``docs/methods.md``).

**The contract** (``docs/design.md``, "The method contract"). A method declares, once, as class
attributes: its hyperparameters (:class:`core.params.ParamSet`, with bounds, defaults, search
scale, paper presets and the modes that read each one), its modes (:class:`core.modes.Mode`:
for each statistic it computes, where the statistic comes from), and its privacy argument.
Config validation, the search space's encoding, the trial spec, ``dpsweep config --method``,
the README tables, ``dp_valid`` and its reason all derive from that declaration.

Privacy bookkeeping: every step appends one Poisson-subsampled Gaussian event (in
``core.events``' form) with the step's *whitened* noise multiplier (noise std over sensitivity,
taken per layer where the method bounds each layer separately) to ``ledger``; the trial checks
the ledger against the calibrated schedule the accountant certified, so a method cannot
silently spend more than it was granted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from core.errors import UserInputError
from core.events import PoissonSubsampledGaussian
from core.lazy import lazy_module
from core.modes import Mode
from core.params import Param, ParamSet, ValidatedParams
from core.schedule import Schedule
from trainables.dp.optim import Update
from trainables.engine.grad_engine import GradEngine, PerExampleView
from trainables.engine.host_reads import host_resident
from trainables.engine.norms import scaled_sq_norms
from trainables.models.trainable import TrainableLayers, trainable_layers

if TYPE_CHECKING:
    import torch

    from trainables.dp.randomness import Randomness
    from trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

#: Added to norms before dividing by them: a zero gradient is clipped by a finite factor.
NORM_EPS = 1e-6
#: The guard never passes a coefficient above this, so that the scaled output gradients c x b
#: of the weighted sum stay finite in float32 for |b| < 2^27 (a block of norm below C / 2^100
#: then contributes less than its rule asked, which is within the bound).
MAX_COEFFICIENT = 2.0 ** 100
#: Relative excess over the bound that the guard treats as rounding of the method's own rule
#: (float64 arithmetic on float64 norms) rather than as the rule overreaching: it still caps
#: such an example, but only a larger excess is counted in ``guard_capped``.
GUARD_ROUNDING = 1e-9
#: Examples per per-example-gradient chunk unless the config says otherwise (memory bound).
DEFAULT_PHYSICAL_BATCH = 512
#: A ledger event's keys: those of ``core.events``' Poisson-subsampled Gaussian.
_EVENT_KEYS = tuple(PoissonSubsampledGaussian(sampling_probability=1.0, noise_multiplier=1.0)
                    .to_dict())

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


def example_norms(norms: torch.Tensor) -> torch.Tensor:
    """[B] each example's whole-gradient norm from its [B, L] layer norms (float64, scaled so
    that tiny layer norms do not vanish when squared)."""
    return scaled_sq_norms(norms).sqrt().to(norms.dtype)


def bound_coefficients(coef: torch.Tensor, norms: torch.Tensor, *, sensitivity: float,
                       layer_bounds: Sequence[float] | torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(coefficients capped so every realised contribution meets the bound, each example's
    requested realised norm over its bound).

    The realised contribution of example i to layer l is coef[i, l] x ||g_il||; the bound is
    ``layer_bounds[l]`` per layer where the method declares per-layer bounds, else
    ``sensitivity`` on the example's whole contribution. Computed in float64 from the engine's
    float64 norms, so the cap is exact up to the rounding of the float32 products that follow.
    ``layer_bounds`` may be a tensor on the norms' device already (:meth:`DPStep.bounded`
    passes one: copying a list to an accelerator every step would wait for it).
    """
    n = norms.to(torch.float64)
    c = coef.to(device=n.device, dtype=torch.float64)
    c = torch.where((n > 0) & torch.isfinite(c), c, torch.zeros_like(c)).clamp(0, MAX_COEFFICIENT)
    # an infinite norm (a non-finite gradient, or a cancellation the engine could not resolve
    # without a host read) with a zero coefficient gives nothing, not 0 x inf = NaN
    realised = torch.where(c > 0, c * n, torch.zeros_like(c))
    if layer_bounds is not None:
        bounds = (layer_bounds if isinstance(layer_bounds, torch.Tensor) else torch.tensor(
            layer_bounds)).to(device=n.device, dtype=torch.float64).unsqueeze(0)
        ratio = torch.where(bounds > 0, realised / bounds,
                            torch.where(realised > 0, math.inf, 0.0))
        c = c * torch.where(ratio > 1, 1 / ratio, 1.0)
        return c, ratio.amax(dim=1) if ratio.shape[1] else ratio.sum(dim=1)
    if not math.isfinite(sensitivity):
        return c, torch.zeros(c.shape[0], dtype=torch.float64, device=n.device)
    ratio = example_norms(realised) / sensitivity if sensitivity > 0 else torch.where(
        realised.sum(dim=1) > 0, math.inf, 0.0)
    return c * torch.where(ratio > 1, 1 / ratio, 1.0).unsqueeze(1), ratio


def ledger_event(*, sample_rate: float, noise_multiplier: float, count: int = 1
                 ) -> dict[str, Any]:
    """``count`` steps at one multiplier in ``core.events``' form: a finite positive multiplier
    is built (and so checked) as a :class:`PoissonSubsampledGaussian`.

    A step may have a multiplier no accounting event takes, and the ledger must still count it
    so that :func:`trainables.training.loop.verify_ledger` compares every step with the certified
    schedule: inf (no live layer: the step released nothing, and passes) or 0 (no noise on a
    bounded sum: a broken method, which that check refuses; so is a negative or NaN one). Such
    a step gets the same keys, the event of a unit multiplier with its own written in.
    """
    m = float(noise_multiplier)
    if 0.0 < m < math.inf:
        return PoissonSubsampledGaussian(sampling_probability=sample_rate, noise_multiplier=m,
                                         count=count).to_dict()
    return {**PoissonSubsampledGaussian(sampling_probability=sample_rate, noise_multiplier=1.0,
                                        count=count).to_dict(), "noise_multiplier": m}


@dataclass
class Ledger:
    """Serialisable record of accounting events: runs of identical subsampled Gaussian steps,
    each ``PoissonSubsampledGaussian.to_dict()`` (see :func:`ledger_event`)."""

    sample_rate: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, noise_multiplier: float) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and math.isclose(last["noise_multiplier"], noise_multiplier,
                                             rel_tol=1e-9):
            last["count"] += 1
        else:
            self.events.append(ledger_event(sample_rate=self.sample_rate,
                                            noise_multiplier=noise_multiplier))

    @property
    def steps(self) -> int:
        return sum(e["count"] for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "events": [dict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ledger:
        """Inverse of :meth:`to_dict`; every event is rebuilt, so one in any other form (a
        checkpoint written before the ledger used ``core.events``) is refused by name."""
        events = []
        for e in d["events"]:
            if not isinstance(e, Mapping) or e.get("kind") != PoissonSubsampledGaussian.kind \
                    or set(e) != set(_EVENT_KEYS):
                raise UserInputError(field="checkpoint.ledger", value=repr(e)[:200],
                                     allowed=f"events with the keys {_EVENT_KEYS} "
                                             "(core.events.PoissonSubsampledGaussian)")
            events.append(ledger_event(sample_rate=e["sampling_probability"],
                                       noise_multiplier=e["noise_multiplier"], count=e["count"]))
        return cls(sample_rate=float(d["sample_rate"]), events=events)


@dataclass(frozen=True)
class PublicData:
    """The public shadow pool and the seeded generator that draws batches from it."""

    x: torch.Tensor
    y: torch.Tensor
    generator: torch.Generator
    #: Where batches are used (the model's device), when the pool stays in host memory.
    device: torch.device | None = None

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform batch of the public pool (no privacy cost: not private data), on the
        model's device; its order is drawn on the host and copied without a wait."""
        from trainables.dp.randomness import to_device

        idx = torch.randperm(self.x.shape[0], generator=self.generator)[:size]
        x, y = self.x[to_device(idx, self.x.device)], self.y[to_device(idx, self.y.device)]
        if self.device is None:
            return x, y
        return to_device(x, self.device), to_device(y, self.device)


class DPStep:
    """Base of every DP method; see the module docstring for the call order and the contract.

    ``noise_schedule`` is the calibrated schedule (what the accountant certified); ``sigma_t``
    of the current step comes from it. ``expected_batch_size`` is q * N, the Poisson batch's
    mean.
    """

    #: Steps between this instance's refreshes from public data (None: it has none); a
    #: benchmark times whole periods so every timed call holds one refresh.
    public_refresh_every: int | None = None

    # ---- the declaration (class level; see the module docstring) ---------------------------
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

    # ---- construction ------------------------------------------------------------------------
    def __init__(
        self,
        *,
        model: LayeredModel | TrainableLayers,
        params: Mapping[str, Any],
        noise_schedule: Schedule,
        sample_rate: float,
        expected_batch_size: float,
        randomness: Randomness,
        steps_per_epoch: int = 1,
        public: PublicData | None = None,
        max_physical_batch: int = DEFAULT_PHYSICAL_BATCH,
    ) -> None:
        p = self.validate_params(params)
        if expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
        self.params = p
        self.mode = self.mode_named(p["mode"])
        self.lr = float(p["lr"])
        self.clip_norm = float(p["clip_norm"])
        self.steps_per_epoch = int(steps_per_epoch)
        self.noise_schedule = noise_schedule
        self.total_steps = noise_schedule.steps
        self.public = public
        #: What the step trains: the model's trainable parameters, in layers (a frozen layer is
        #: no layer here; a parameter of a parent is one of its own; ``TrainableLayers``).
        self.model = trainable_layers(model)
        self.expected_batch_size = float(expected_batch_size)
        self.randomness = randomness
        self.max_physical_batch = max_physical_batch
        self.layer_of = self.model.layer_of_parameter()
        first = next(iter(self.model.parameters()), None)
        #: Where the model trains, and where a method keeps the state its step reads.
        self.device = torch.device("cpu") if first is None else first.device
        self.num_layers = len(self.model.layer_names)
        self.step_count = 0
        #: The guard's counters (:attr:`guard_capped`, :attr:`last_guard_ratio`), tensors on
        #: the device once a release has been guarded: a step never reads them.
        self._guard_capped: torch.Tensor | int = 0
        self._guard_ratio: torch.Tensor | float = 0.0
        self._constants: dict[str, tuple[tuple[Any, ...], torch.Tensor]] = {}  # by name
        self.ledger = Ledger(sample_rate=sample_rate)
        self.optimizer = self._make_optimizer(lr=self.lr, momentum=float(p.get("momentum", 0.0)))
        self.engine = GradEngine(self.model, max_physical_batch=max_physical_batch)

    # ---- the guard's counters: on the device, read where they are recorded -------------------
    @property
    def guard_capped(self) -> int:
        """Example-steps whose own coefficients overreached the bound and were capped by the
        guard (0 for a sound rule; recorded with the trial's privacy record). Counted on the
        device: reading it waits for the device, so only the record and a checkpoint do."""
        return int(self._guard_capped)

    @property
    def last_guard_ratio(self) -> float:
        """The largest requested realised norm over its bound at the last guarded release."""
        return float(self._guard_ratio)

    def device_constant(self, name: str, values: Sequence[float], *, device: torch.device,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
        """``values`` as a tensor on ``device`` (float64 unless ``dtype``), copied again only
        when they change (a refresh, a controller step): a copy from the host to an accelerator
        per step would make the host wait for the device's queue, as
        ``torch.tensor(..., device=...)`` does."""
        dtype = torch.float64 if dtype is None else dtype
        key = (tuple(float(v) for v in values), str(device), dtype)
        held = self._constants.get(name)
        if held is None or held[0] != key:
            from trainables.dp.randomness import to_device

            held = (key, to_device(torch.tensor(key[0], dtype=dtype), torch.device(device)))
            self._constants[name] = held
        return held[1]

    # ---- validity (derived from the mode's declaration) --------------------------------------
    @property
    def dp_valid(self) -> bool:
        """Whether the accountant's epsilon is a valid claim for this configuration."""
        return self.mode.dp_valid

    @property
    def validity_reason(self) -> str:
        return self.mode.validity_reason(argument=self.argument)

    # ---- schedule ----------------------------------------------------------------------------
    def sigma_at(self, step: int) -> float:
        """Noise multiplier the calibrated schedule grants to step ``step`` (0-based)."""
        try:
            return self.noise_schedule.sigma_at(step)
        except IndexError:
            raise RuntimeError("step beyond the calibrated schedule: the accountant did not "
                               "cover it") from None

    def refresh_period(self, every: int | None, *, public_batch: int) -> int:
        """Steps between public refreshes: ``every`` when the user set it, else the fewest
        steps whose private examples are >= public_batch / PUBLIC_SHARE (``public_every``)."""
        if every is not None:
            return int(every)
        # rounded before ceil: the expected batch q * N carries float error, which must not
        # push a whole quotient up one step
        return max(1, math.ceil(round(public_batch / (PUBLIC_SHARE * self.expected_batch_size),
                                      9)))

    def refresh_due(self, step: int, *, last: int | None) -> bool:
        """Whether a public refresh is due at ``step`` (``last``: the step of the previous one,
        None before the first) under ``public_refresh_every``."""
        if self.public_refresh_every is None:
            raise RuntimeError(f"{self.name}: no public refresh period in mode {self.mode.name}")
        return last is None or step - last >= self.public_refresh_every

    def public_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform batch of the public shadow pool (no privacy cost: not private data)."""
        if self.public is None:
            raise RuntimeError(f"{self.name}: mode {self.mode.name} needs the public shadow pool")
        return self.public.batch(size)

    # ---- phase 1 -----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Adapt per-step state; must use only public data or already released outputs."""

    def trainable_layers(self) -> list[bool]:
        """Which layers receive gradients, noise and updates at the current step."""
        return [True] * self.num_layers

    # ---- phase 2 -----------------------------------------------------------------------------
    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> PerExampleView:
        """The per-example gradient view of the live layers for a batch (one forward and one
        backward; per-layer ghost or materialised norms; weighted sums by book-keeping)."""
        return self.engine.compute(x, y, live=self.trainable_layers())

    # ---- phase 3 -----------------------------------------------------------------------------
    def sensitivity(self) -> float:
        """L2 bound on any one example's contribution to the summed gradient."""
        return self.clip_norm

    def layer_bounds(self) -> list[float] | None:
        """Per-layer L2 bounds when the method clips each layer separately, else None."""
        return None

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """[B, L] scale factors; default: flat clipping of the whole gradient at C."""
        factor = (self.clip_norm / (example_norms(norms) + NORM_EPS)).clamp(max=1.0)
        return factor.unsqueeze(1).expand(-1, self.num_layers)

    def bounded(self, coef: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """The final guard on every release: ``coef`` capped so that each example's realised
        contribution meets ``layer_bounds()`` / ``sensitivity()`` whatever the rule computed
        (an underflowed norm, an overflowing coefficient, a bug); caps beyond rounding are
        counted in ``guard_capped``. Nothing is read on the host: the counters stay tensors."""
        bounds = self.layer_bounds()
        capped, ratio = bound_coefficients(
            coef, norms, sensitivity=self.sensitivity(),
            layer_bounds=None if bounds is None else self.device_constant(
                "layer_bounds", bounds, device=norms.device))
        self._guard_ratio = ratio.max() if ratio.numel() else ratio.new_zeros(())
        self._guard_capped = self._guard_capped + (ratio > 1 + GUARD_ROUNDING).sum()
        return capped

    def clip(self, view: PerExampleView) -> dict[str, torch.Tensor]:
        """Sum of the clipped per-example gradients, per trainable parameter, through the
        guard (a method that overrides this must release through ``bounded`` too)."""
        return view.weighted_sum(self.bounded(self.clip_coefficients(view.norms), view.norms))

    # ---- phase 4 -----------------------------------------------------------------------------
    def noise_std(self) -> list[float]:
        """Std of the Gaussian noise added to each layer's summed block (0 for frozen layers)."""
        s = self.sigma_at(self.step_count) * self.clip_norm
        return [s if live else 0.0 for live in self.trainable_layers()]

    def whitened_noise_multiplier(self) -> float:
        """Noise multiplier of the step as one Gaussian mechanism (what the accountant sees).

        With per-layer bounds C_l and stds s_l, whitening each block by s_l gives unit noise and
        sensitivity sqrt(sum (C_l/s_l)^2); with one global bound C, the adversary puts all of its
        norm in the least-noised live layer, so the multiplier is min s_l / C.
        """
        stds = self.noise_std()
        bounds = self.layer_bounds()
        if bounds is not None:
            total = 0.0
            for c, s in zip(bounds, stds, strict=True):
                if c > 0:
                    if s <= 0:
                        return 0.0
                    total += (c / s) ** 2
            return math.inf if total == 0 else 1.0 / math.sqrt(total)
        live = [s for s, on in zip(stds, self.trainable_layers(), strict=True) if on]
        return min(live) / self.sensitivity() if live else math.inf

    def noise(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        stds = self.noise_std()
        out = {}
        for n, s in summed.items():
            std = stds[self.layer_of[n]]
            out[n] = s + std * self.randomness.normal(s.shape, dtype=s.dtype) if std > 0 else s
        return out

    # ---- phase 5 -----------------------------------------------------------------------------
    def _make_optimizer(self, *, lr: float, momentum: float) -> Update:
        return Update(self.model.named_parameters(), kind=self.optimizer_name, lr=lr,
                      momentum=momentum if self.optimizer_name == "sgd" else 0.0)

    def update(self, noisy: dict[str, torch.Tensor]) -> None:
        """Average by the expected batch size (Poisson batches vary) and take an optimizer step.

        Parameters without a released gradient keep ``grad=None``, so the update leaves them
        (and their state) bit-identical.
        """
        for n, p in self.model.named_parameters():
            g = noisy.get(n)
            p.grad = None if g is None else g / self.expected_batch_size
        self.optimizer.step()
        self._mark_host_counters()

    def _mark_host_counters(self) -> None:
        """Adam's step counters stay on the host beside parameters on any device (torch's
        ``capturable=False``), and torch reads them every step without waiting for the device:
        marked so that the host-read guard knows them (``trainables.engine.host_reads``)."""
        host_resident(*(s["step"] for s in self.optimizer.state.values() if "step" in s))

    # ---- phase 6 -----------------------------------------------------------------------------
    def end_step(self, noisy: dict[str, torch.Tensor]) -> None:
        """Post-process the released noisy gradient (e.g. for lagged statistics)."""

    # ---- the step ----------------------------------------------------------------------------
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One DP step on a Poisson batch; returns the per-example losses (monitoring only).

        An empty batch still releases noise and updates, as Opacus does: skipping would make
        the output depend on whether the batch was empty, which the accountant does not model.
        """
        self.begin_step(self.step_count)
        live = self.trainable_layers()
        if x.shape[0] > 0:
            view = self.gradients(x, y)
            summed = self.clip(view)
            losses = view.losses
        else:
            summed = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()
                      if live[self.layer_of[n]]}
            losses = torch.zeros(0, device=x.device)
        multiplier = self.whitened_noise_multiplier()
        noisy = self.noise(summed)
        self.update(noisy)
        self.end_step(noisy)
        self.ledger.add(multiplier)
        self.step_count += 1
        return losses

    def epoch_metrics(self) -> dict[str, float]:
        """Method-specific values logged with each epoch's metrics (e.g. the clipping norm)."""
        return {"clip_norm": self.clip_norm}

    def trajectories(self) -> dict[str, list[float]]:
        """Per-step or per-probe series stored with the trial (e.g. WW's C_t and zeta)."""
        return {}

    def extra_record(self) -> dict[str, Any]:
        """Method-specific facts for the privacy record (risk vector, thresholds, ...)."""
        return {}

    # ---- checkpointing -----------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Method-specific state to checkpoint (tensors, numbers, lists, dicts only)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        del state

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs; the noise's and sampler's states only if reproducible."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "randomness": self.randomness.state(),
            "step_count": self.step_count,
            "guard_capped": self.guard_capped,
            "ledger": self.ledger.to_dict(),
            "public_rng": None if self.public is None else self.public.generator.get_state(),
            "extra": self.extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self._mark_host_counters()
        self.randomness.load_state(state["randomness"])
        self.step_count = int(state["step_count"])
        self._guard_capped = int(state["guard_capped"])
        self.ledger = Ledger.from_dict(state["ledger"])
        if self.public is not None and state.get("public_rng") is not None:
            self.public.generator.set_state(state["public_rng"])
        self.load_extra_state(state["extra"])
