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

**The contract** (what a method declares once, and what derives from it) is
:class:`trainables.dp.contract.MethodContract`, which ``DPStep`` extends; the privacy
bookkeeping (the ``ledger`` of accounting events every step appends to) is
:mod:`trainables.dp.ledger`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpsweep.core.lazy import lazy_module
from dpsweep.core.poisson import PHYSICAL_BATCH
from dpsweep.core.schedule import Schedule
from dpsweep.trainables.dp.contract import PUBLIC_SHARE, MethodContract
from dpsweep.trainables.dp.ledger import Ledger, whitened_multiplier
from dpsweep.trainables.dp.optim import Update
from dpsweep.trainables.engine.grad_engine import GradEngine, PerExampleView
from dpsweep.trainables.engine.host_reads import host_resident, to_device
from dpsweep.trainables.engine.norms import scaled_sq_norms
from dpsweep.trainables.models.trainable import TrainableLayers, trainable_layers

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.dp.randomness import Randomness
    from dpsweep.trainables.models.networks import LayeredModel
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


def clipped_fraction(norms: torch.Tensor, *, bounds: torch.Tensor | None,
                     sensitivity: float) -> torch.Tensor | None:
    """The fraction of a release's examples that its rule clips, as a device scalar (None for
    an empty batch or a rule with no bound): monitoring only, a statistic of private examples
    without noise (declared not covered in the results store); it changes nothing released.

    An example is clipped when any norm the method's rule bounds exceeds its bound: a layer's
    norm its layer's bound under per-layer clipping (``bounds``), the whole norm the
    sensitivity otherwise (for a normalising rule such as AUTO-S: the examples it scales down
    from above C). A rule with no bound (infinite sensitivity) clips none by a bound."""
    if norms.shape[0] == 0 or (bounds is None and not math.isfinite(sensitivity)):
        return None
    n = norms.to(torch.float64)
    over = ((n > bounds.to(torch.float64).unsqueeze(0)).any(dim=1) if bounds is not None
            else example_norms(n) > sensitivity)
    return over.sum(dtype=torch.float64) / norms.shape[0]


class ClipCount:
    """The releases' :func:`clipped_fraction` summed on the device since the last read."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | float = 0.0
        self._releases = 0

    def add(self, fraction: torch.Tensor | None) -> None:
        """One release's fraction (None: nothing to count); nothing is read on the host."""
        if fraction is not None:
            self._sum, self._releases = self._sum + fraction, self._releases + 1

    def take(self) -> float | None:
        """The mean over the releases since the last call (None: none), restarted; the loop
        reads it once per epoch, its one wait for the device."""
        (total, releases), self._sum, self._releases = (self._sum, self._releases), 0.0, 0
        return None if releases == 0 else float(total) / releases


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
        idx = torch.randperm(self.x.shape[0], generator=self.generator)[:size]
        x, y = self.x[to_device(idx, self.x.device)], self.y[to_device(idx, self.y.device)]
        if self.device is None:
            return x, y
        return to_device(x, self.device), to_device(y, self.device)


class DPStep(MethodContract):
    """Base of every DP method; see the module docstring for the call order and the contract.

    ``noise_schedule`` is the calibrated schedule (what the accountant certified); ``sigma_t``
    of the current step comes from it. ``expected_batch_size`` is q * N, the Poisson batch's
    mean.
    """

    #: Steps between this instance's refreshes from public data (None: it has none); a
    #: benchmark times whole periods so every timed call holds one refresh.
    public_refresh_every: int | None = None

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
        max_physical_batch: int = PHYSICAL_BATCH,
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
        #: Each guarded release's fraction of clipped examples, read once per epoch.
        self.clipped = ClipCount()
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
        held = None if bounds is None else self.device_constant("layer_bounds", bounds,
                                                                 device=norms.device)
        capped, ratio = bound_coefficients(coef, norms, sensitivity=self.sensitivity(),
                                           layer_bounds=held)
        self._guard_ratio = ratio.max() if ratio.numel() else ratio.new_zeros(())
        self._guard_capped = self._guard_capped + (ratio > 1 + GUARD_ROUNDING).sum()
        self.clipped.add(clipped_fraction(norms, bounds=held, sensitivity=self.sensitivity()))
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
        """Noise multiplier of the step as one Gaussian mechanism (what the accountant sees):
        :func:`trainables.dp.ledger.whitened_multiplier` of this step's stds and bounds."""
        return whitened_multiplier(stds=self.noise_std(), layer_bounds=self.layer_bounds(),
                                   live=self.trainable_layers, sensitivity=self.sensitivity)

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
