"""One DP step with named phases, shared by every method.

Call order, once per Poisson batch (the training loop drives it through :meth:`DPStep.step`):

1. ``begin_step(step)``        adapt state, only from public data or released outputs
2. ``per_example_grads(x, y)`` per-example gradients of the trainable parameters (torch.func)
3. ``clip(grads)``             per-example clip / reweight, then sum; bounded by ``sensitivity``
4. ``noise(summed)``           Gaussian noise per layer with std ``noise_std()[layer]``
5. ``update(noisy)``           noisy sum / expected batch size into the optimizer
6. ``end_step(noisy)``         post-processing of the released noisy gradient

A method overrides only the phase it changes. The usual override is ``clip_coefficients``: a
[B, L] matrix of per-example, per-layer scale factors, so the clipped sum is one einsum per
parameter and the sensitivity of every example can be checked from its layer norms alone (the
conformance suite does exactly that with adversarial norms).

Privacy bookkeeping: every step appends one Poisson-subsampled Gaussian event with the step's
*whitened* noise multiplier (noise std over sensitivity, taken per layer where the method bounds
each layer separately) to ``ledger``; the trial checks the ledger against the calibrated schedule
the accountant certified, so a method cannot silently spend more than it was granted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from trainables.models import LayeredModel

_NORM_EPS = 1e-6


@dataclass(frozen=True)
class NoisePhase:
    """``steps`` consecutive steps at noise multiplier ``noise_multiplier``."""

    noise_multiplier: float
    steps: int


@dataclass
class PerExampleGrads:
    """Per-example gradients of the trainable parameters and their per-layer norms."""

    grads: dict[str, torch.Tensor]  # parameter name -> [B, *param.shape]
    norms: torch.Tensor  # [B, L] per-example L2 norm of each layer's block (0 if frozen)
    losses: torch.Tensor  # [B] per-example loss, for monitoring only

    @classmethod
    def from_grads(cls, grads: dict[str, torch.Tensor], *, layer_of: dict[str, int],
                   num_layers: int, losses: torch.Tensor | None = None) -> PerExampleGrads:
        """Attach per-layer norms (one pass over the blocks; they come free with the grads)."""
        first = next(iter(grads.values()))
        sq = torch.zeros(first.shape[0], num_layers, device=first.device, dtype=first.dtype)
        for n, g in grads.items():
            sq[:, layer_of[n]] += g.flatten(1).pow(2).sum(dim=1)
        if losses is None:
            losses = torch.zeros(first.shape[0], device=first.device)
        return cls(grads=grads, norms=sq.sqrt(), losses=losses)


@dataclass
class Ledger:
    """Serialisable record of accounting events: runs of identical subsampled Gaussian steps."""

    sample_rate: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, noise_multiplier: float) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and math.isclose(last["noise_multiplier"], noise_multiplier,
                                             rel_tol=1e-9):
            last["count"] += 1
        else:
            self.events.append({"event": "poisson_subsampled_gaussian",
                                "sampling_probability": self.sample_rate,
                                "noise_multiplier": noise_multiplier, "count": 1})

    @property
    def steps(self) -> int:
        return sum(e["count"] for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "events": [dict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ledger:
        return cls(sample_rate=float(d["sample_rate"]), events=[dict(e) for e in d["events"]])


class DPStep:
    """Base of every DP method; see the module docstring for the call order.

    ``noise_schedule`` is the calibrated schedule (what the accountant certified); ``sigma_t`` for
    the current step comes from it. ``expected_batch_size`` is q * N, the Poisson batch's mean.
    """

    name: ClassVar[str] = "base"
    #: Hyperparameters this method adds to lr and clip_norm, with their defaults.
    extra_params: ClassVar[dict[str, Any]] = {}
    #: Named presets. "paper" holds the paper's defaults: method params and, where the paper
    #: fixes them, "lr" / "clip_norm" / "momentum".
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Optimiser the method's update rule uses.
    optimizer_name: ClassVar[str] = "sgd"

    # ---- class-level hooks the orchestrator calls before any trial --------------------
    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Check method hyperparameters; raise UserInputError naming ``method_params.KEY``.

        Subclasses extend this with range checks; the base rejects unknown keys and fills
        defaults, so a typo never silently trains with a default.
        """
        from core.errors import UserInputError

        for key in params:
            if key not in cls.extra_params:
                raise UserInputError(field=f"method_params.{key}", value=params[key],
                                     allowed=f"a hyperparameter of {cls.name}: "
                                             f"{sorted(cls.extra_params) or 'none'}")
        return {**cls.extra_params, **params}

    @classmethod
    def noise_shape(cls, *, epochs: int, steps_per_epoch: int,
                    params: dict[str, Any]) -> list[NoisePhase]:
        """Relative noise schedule the accountant scales to the budget (default: constant)."""
        del params
        return [NoisePhase(noise_multiplier=1.0, steps=epochs * steps_per_epoch)]

    @classmethod
    def prepare(cls, *, data: Any, model_factory: Any, params: dict[str, Any], seed: int,
                cache_dir: Any) -> dict[str, Any]:
        """Once-per-sweep work on public data only (e.g. a risk vector); returns params to add.

        ``model_factory()`` builds a fresh model of the trial's architecture. The result must be
        plain data (it travels in every trial's spec) and be cached in ``cache_dir``.
        """
        del data, model_factory, params, seed, cache_dir
        return {}

    def __init__(
        self,
        *,
        model: LayeredModel,
        lr: float,
        clip_norm: float,
        noise_schedule: Sequence[NoisePhase],
        sample_rate: float,
        expected_batch_size: float,
        noise_generator: torch.Generator,
        momentum: float = 0.0,
        max_physical_batch: int = 512,
        steps_per_epoch: int = 1,
        public_data: tuple[torch.Tensor, torch.Tensor] | None = None,
        public_generator: torch.Generator | None = None,
        **params: Any,
    ) -> None:
        params = self.validate_params(params)
        if not (clip_norm > 0 and math.isfinite(clip_norm)):
            raise ValueError(f"clip_norm must be positive, got {clip_norm}")
        if expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
        self.params = params
        self.steps_per_epoch = int(steps_per_epoch)
        self.total_steps = sum(p.steps for p in noise_schedule)
        self.public_data = public_data
        self.public_generator = public_generator
        self.model = model
        self.lr = lr
        self.clip_norm = float(clip_norm)
        self.noise_schedule = tuple(noise_schedule)
        self.expected_batch_size = float(expected_batch_size)
        self.noise_generator = noise_generator
        self.max_physical_batch = max_physical_batch
        self.layer_of = model.layer_of_parameter()
        self.num_layers = len(model.layer_names)
        self.step_count = 0
        self.ledger = Ledger(sample_rate=sample_rate)
        self.optimizer = self._make_optimizer(lr=lr, momentum=momentum)

    # ---- validity -----------------------------------------------------------------------
    @property
    def dp_valid(self) -> bool:
        """Whether the accountant's epsilon is a valid claim for this configuration."""
        return True

    @property
    def validity_reason(self) -> str:
        return "per-example sensitivity bounded; noise calibrated by the accountant"

    # ---- schedule -----------------------------------------------------------------------
    def sigma_at(self, step: int) -> float:
        """Noise multiplier the calibrated schedule grants to step ``step`` (0-based)."""
        for phase in self.noise_schedule:
            if step < phase.steps:
                return phase.noise_multiplier
            step -= phase.steps
        raise RuntimeError("step beyond the calibrated schedule: the accountant did not cover it")

    def public_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform batch of the public shadow pool (no privacy cost: not private data)."""
        if self.public_data is None or self.public_generator is None:
            raise RuntimeError(f"{self.name}: this mode needs the public shadow pool")
        x, y = self.public_data
        idx = torch.randperm(x.shape[0], generator=self.public_generator)[:size]
        idx = idx.to(x.device)
        return x[idx], y[idx]

    # ---- phase 1 ------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Adapt per-step state; must use only public data or already released outputs."""

    def trainable_layers(self) -> list[bool]:
        """Which layers receive gradients, noise and updates at the current step."""
        return [True] * self.num_layers

    # ---- phase 2 ------------------------------------------------------------------------
    def per_example_grads(self, x: torch.Tensor, y: torch.Tensor) -> PerExampleGrads:
        live = self.trainable_layers()
        model = self.model
        trainable = {n: p.detach() for n, p in model.named_parameters() if live[self.layer_of[n]]}
        fixed = {n: p.detach() for n, p in model.named_parameters() if not live[self.layer_of[n]]}

        def loss_one(tp: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor):
            out = functional_call(model, {**tp, **fixed}, (xi.unsqueeze(0),))
            return F.cross_entropy(out, yi.unsqueeze(0))

        chunk = self.max_physical_batch if x.shape[0] > self.max_physical_batch else None
        grads, losses = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0), chunk_size=chunk)(
            trainable, x, y
        )
        return PerExampleGrads.from_grads(grads, layer_of=self.layer_of,
                                          num_layers=self.num_layers, losses=losses.detach())

    # ---- phase 3 ------------------------------------------------------------------------
    def sensitivity(self) -> float:
        """L2 bound on any one example's contribution to the summed gradient."""
        return self.clip_norm

    def layer_bounds(self) -> list[float] | None:
        """Per-layer L2 bounds when the method clips each layer separately, else None."""
        return None

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """[B, L] scale factors; default: flat clipping of the whole gradient at C."""
        total = norms.pow(2).sum(dim=1).sqrt()
        factor = (self.clip_norm / (total + _NORM_EPS)).clamp(max=1.0)
        return factor.unsqueeze(1).expand(-1, self.num_layers)

    def clip(self, grads: PerExampleGrads) -> dict[str, torch.Tensor]:
        """Sum of the clipped per-example gradients, per trainable parameter."""
        coef = self.clip_coefficients(grads.norms)
        return {
            n: torch.einsum("i,i...->...", coef[:, self.layer_of[n]], g)
            for n, g in grads.grads.items()
        }

    # ---- phase 4 ------------------------------------------------------------------------
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
            if std > 0:
                z = torch.randn(s.shape, generator=self.noise_generator, device=s.device,
                                dtype=s.dtype)
                out[n] = s + std * z
            else:
                out[n] = s
        return out

    # ---- phase 5 ------------------------------------------------------------------------
    def _make_optimizer(self, *, lr: float, momentum: float) -> torch.optim.Optimizer:
        params = list(self.model.parameters())
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    def update(self, noisy: dict[str, torch.Tensor]) -> None:
        """Average by the expected batch size (Poisson batches vary) and take an optimizer step.

        Parameters without a released gradient keep ``grad=None``, so torch's optimizers leave
        them (and their state) bit-identical.
        """
        for n, p in self.model.named_parameters():
            g = noisy.get(n)
            p.grad = None if g is None else g / self.expected_batch_size
        self.optimizer.step()

    # ---- phase 6 ------------------------------------------------------------------------
    def end_step(self, noisy: dict[str, torch.Tensor]) -> None:
        """Post-process the released noisy gradient (e.g. for lagged statistics)."""

    # ---- the step -----------------------------------------------------------------------
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One DP step on a Poisson batch; returns the per-example losses (monitoring only).

        An empty batch still releases noise and updates, as Opacus does: skipping would make
        the output depend on whether the batch was empty, which the accountant does not model.
        """
        self.begin_step(self.step_count)
        live = self.trainable_layers()
        if x.shape[0] > 0:
            grads = self.per_example_grads(x, y)
            summed = self.clip(grads)
            losses = grads.losses
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
        """Method-specific facts for the privacy record (mode, risk vector, ...); JSON-safe."""
        return {}

    # ---- checkpointing ------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Method-specific state to checkpoint (tensors, numbers, lists, dicts only)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        del state

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "noise_rng": self.noise_generator.get_state(),
            "step_count": self.step_count,
            "ledger": self.ledger.to_dict(),
            "public_rng": (None if self.public_generator is None
                           else self.public_generator.get_state()),
            "extra": self.extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.noise_generator.set_state(state["noise_rng"])
        self.step_count = int(state["step_count"])
        self.ledger = Ledger.from_dict(state["ledger"])
        if self.public_generator is not None and state.get("public_rng") is not None:
            self.public_generator.set_state(state["public_rng"])
        self.load_extra_state(state["extra"])
