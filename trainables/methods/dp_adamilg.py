"""dp_adamilg — importance-based layer-wise clipping and noise, decaying noise, Adam (Li, Liang,
Jiang & Zhang, "Differentially Private Deep Learning with Importance-based Adaptive Gradient
Processing", ACML 2024).

Per layer j with n_j parameters the paper takes the importance h_j = ||g(j)|| / sqrt(n_j), the
threshold s_j = alpha * h_j and per-layer noise std s_j * sqrt(n_j) * sigma_t; sigma_t decays by
epoch, sigma_t = max(sigma_0 / (1 + k t), sigma_floor), and the update is Adam.

Privacy argument, per ``mode``:

* ``public`` (default, sound). Each example's gradient is clipped per layer at C_j (coefficient
  min(1, C_j / ||g_ij||)), so its contribution to layer j is <= C_j and to the whole sum
  <= sqrt(sum_j C_j^2) = C. The C_j are proportional to alpha * h_j with h_j from one ordinary
  backward pass on a batch of the *public* shadow pool at the current weights, so they depend
  on no private example. Layer j gets noise std sigma_t * C_j * sqrt(J); whitening each block
  by its std gives sensitivity sqrt(sum_j (C_j / std_j)^2) = 1 / sigma_t, so every step is one
  Poisson-subsampled Gaussian mechanism with multiplier exactly sigma_t. The per-epoch schedule
  is composed in the PRV accountant, one mechanism per distinct sigma_t.
* ``lagged`` (sound). As ``public``, but h_j comes from the previous step's released noisy
  gradient: post-processing of an output already paid for. Thresholds are uniform,
  C / sqrt(J), until the first release.
* ``faithful`` (epsilon claim INVALID). The paper's Algorithm 1: no per-example clipping; the
  batch gradient is clipped coordinate-wise at s_j computed from that same batch gradient, and
  the noise std s_j * sqrt(n_j) * sigma_t scales with its norm. One example can move every
  threshold, the clipped sum and the noise scale without bound, so there is no sensitivity to
  calibrate against; the paper's zCDP "parallel composition" over the batches of an epoch does
  not apply either (the batches are adaptive mechanisms on shared weights, not disjoint
  queries). The trial is still reported with the PRV epsilon of its multipliers sigma_t (the
  paper's claimed per-step multiplier), labelled invalid.

Why alpha does not matter in the sound modes: the thresholds are normalised so that
sqrt(sum_j C_j^2) = C, and a common factor alpha cancels in that normalisation. Only the
*relative* importances shape the C_j; alpha matters only in ``faithful`` mode, where it sets
the coordinate threshold relative to the layer's RMS gradient coordinate.

``sigma_floor`` is relative to sigma_0: the relative schedule max(1 / (1 + k t), sigma_floor)
is then scaled by one factor, sigma_0, which the orchestrator calibrates by bisection so the
composed epsilon meets the target. The paper's absolute floor sigma_* = sqrt(2 ln(1.25/delta))
/ epsilon_Lim (its Eq. 7) cannot be part of a shape scaled by one unknown; the absolute floor
that results, sigma_floor * sigma_0, is recorded with the trial.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from dpsweep.core.lazy import lazy_module
from dpsweep.core.modes import Mode, Source
from dpsweep.core.params import Param, ParamSet
from dpsweep.core.schedule import Phase, Schedule
from dpsweep.trainables.dp.contract import CLIP, LR, public_every
from dpsweep.trainables.dp.step import NORM_EPS, DPStep, PerExampleView
from dpsweep.trainables.methods import register

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

#: Smallest share of the budget any layer keeps, as a fraction of the uniform share C/sqrt(J):
#: a layer whose importance is zero (or NaN) is never starved, and nothing divides by zero.
MIN_SHARE = 0.01
#: The statistic the modes differ in.
THRESHOLD_STAT = "layer thresholds (importances)"


def paper_floor(*, sigma_0: float, delta: float = 1e-5, epsilon_lim: float = 1.0) -> float:
    """The paper's floor sigma_* (Eq. 7) relative to its sigma_0 (Table 1).

    The paper gives no value for epsilon_Lim, only that it lies in (0, 1); epsilon_Lim = 1 is
    the edge of that range and gives the lowest floor the paper allows.
    """
    return math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon_lim / sigma_0


def decay_shape(*, epochs: int, k: float, floor: float) -> list[float]:
    """Relative multiplier of each epoch t = 0, 1, ...: max(1 / (1 + k t), floor).

    t counts from 0 so that sigma_0 is the first epoch's multiplier (the paper's Algorithm 1
    loops from t = 1 but calls sigma_0 the initial scale).
    """
    return [max(1.0 / (1.0 + k * t), floor) for t in range(epochs)]


# ---- where the thresholds come from: one strategy per source (modes as data) ---------------
class _Thresholds:
    """Per-example, per-layer clipping at C_j with sqrt(sum C_j^2) = C (the sound modes)."""

    def before_step(self, m: DPAdamILG, step: int) -> None:
        """Public data: refresh before the private batch is touched."""

    def after_release(self, m: DPAdamILG, noisy: dict[str, torch.Tensor]) -> None:
        """Released outputs: post-processing of the noisy gradient."""

    def clip(self, m: DPAdamILG, view: PerExampleView) -> dict[str, torch.Tensor]:
        return DPStep.clip(m, view)

    def noise_std(self, m: DPAdamILG, sigma: float) -> list[float]:
        scale = sigma * math.sqrt(m.num_layers)
        return [scale * c for c in m.bounds]

    def sensitivity(self, m: DPAdamILG) -> float:
        return m.clip_norm

    def layer_bounds(self, m: DPAdamILG) -> list[float] | None:
        return list(m.bounds)


class _PublicThresholds(_Thresholds):
    def before_step(self, m: DPAdamILG, step: int) -> None:
        # The one host read of this mode, on refresh steps only (every ``refresh_every``): the
        # C_j are host numbers, since the noise stds and the ledger's whitened multiplier are
        # computed from them on the host; every other step reads nothing.
        if m.refresh_due(step, last=m.refreshed_at):
            m.set_bounds(m.public_importance())
            m.refreshed_at = step


class _ReleasedThresholds(_Thresholds):
    def after_release(self, m: DPAdamILG, noisy: dict[str, torch.Tensor]) -> None:
        # Reads the release's layer norms on the host at every step (the next step's C_j are
        # host numbers, as in public mode, and change every step here): inherent to this mode
        # as implemented; the default, public mode reads on refresh steps only.
        m.set_bounds(m.layer_rms(noisy))


class _BatchThresholds(_Thresholds):
    """The paper's Algorithm 1 (invalid claim): the batch gradient is clipped coordinate-wise
    at thresholds taken from itself and noised in proportion to them."""

    def before_step(self, m: DPAdamILG, step: int) -> None:
        m.faithful_s = [0.0] * m.num_layers  # an empty batch releases no signal

    def clip(self, m: DPAdamILG, view: PerExampleView) -> dict[str, torch.Tensor]:
        # Thresholds are scale-equivariant, so clipping the sum equals the paper's clipping of
        # the mean times the batch size.
        summed = view.weighted_sum(torch.ones_like(view.norms))
        # a host read every step (the thresholds set the host-side noise stds): this mode
        # reproduces the paper, not a deployable step
        m.faithful_s = [m.alpha * h for h in m.layer_rms(summed)]
        return {n: g.clamp(-m.faithful_s[m.layer_of[n]], m.faithful_s[m.layer_of[n]])
                for n, g in summed.items()}

    def noise_std(self, m: DPAdamILG, sigma: float) -> list[float]:
        return [s * math.sqrt(n) * sigma for s, n in zip(m.faithful_s, m.sizes, strict=True)]

    def sensitivity(self, m: DPAdamILG) -> float:
        return math.inf

    def layer_bounds(self, m: DPAdamILG) -> list[float] | None:
        return None


_THRESHOLDS_FROM: dict[Source, type[_Thresholds]] = {
    Source.PUBLIC: _PublicThresholds, Source.RELEASED: _ReleasedThresholds,
    Source.PRIVATE: _BatchThresholds}


#: The threshold factor (searched in faithful mode: search_spaces/dp_adamilg.py).
ALPHA = Param("alpha", 1.2, "threshold factor s_j = alpha * h_j (Table 1); it cancels in the "
              "sound modes, where thresholds are normalised to sqrt(sum C_j^2) = C",
              low=0.0, low_open=True, high=1e3, modes=("faithful",),
              presets={"paper": 1.2, "paper_cifar10": 1.2})
#: The noise decay rate (searched on a grid: search_spaces/dp_adamilg.py).
K = Param("k", 0.05, "noise decay rate per epoch, sigma_t = sigma_0 / (1 + k t)", low=0.0,
          high=10.0, presets={"paper": 0.05, "paper_cifar10": 0.001})


@register
class DPAdamILG(DPStep):
    name: ClassVar[str] = "dp_adamilg"
    summary: ClassVar[str] = ("per-layer clipping at importance-proportional thresholds, "
                              "per-layer noise with whitened multiplier sigma_t, epoch-wise noise "
                              "decay composed by the accountant, Adam")
    citation: ClassVar[str] = ("Li, Liang, Jiang & Zhang, Differentially Private Deep Learning "
                               "with Importance-based Adaptive Gradient Processing, ACML 2024")
    argument: ClassVar[str] = (
        "per-example per-layer clipping at C_j with sqrt(sum C_j^2) = C, thresholds independent "
        "of the private batch; layer noise sigma_t * C_j * sqrt(J) makes every step a Gaussian "
        "mechanism with whitened multiplier sigma_t; the decaying schedule is composed by the "
        "accountant.")
    optimizer_name: ClassVar[str] = "adam"
    modes: ClassVar[tuple[Mode, ...]] = (
        Mode("public", {THRESHOLD_STAT: Source.PUBLIC, "noise schedule": Source.FIXED},
             doc="importances from one backward pass on a public batch at the current weights"),
        Mode("lagged", {THRESHOLD_STAT: Source.RELEASED, "noise schedule": Source.FIXED},
             doc="importances from the previous released noisy gradient"),
        Mode("faithful", {THRESHOLD_STAT: Source.PRIVATE, "noise schedule": Source.FIXED},
             doc="the paper's Algorithm 1: the batch gradient clipped at thresholds taken from "
                 "itself"),
    )
    # Table 1: alpha = 1.2 everywhere; k = 0.05 and sigma_0 = 10 for MNIST / FMNIST, k = 0.001
    # and sigma_0 = 6 for CIFAR-10/100 and SVHN; the floor is Eq. 7 at delta = 1e-5 (Sec. 5.1)
    # relative to that sigma_0. The paper states no learning rate; lr is Adam's own default
    # (Kingma & Ba, 2014, which the paper cites for its update). No per-example C exists in the
    # paper, so clip_norm is left to the sweep.
    params: ClassVar[ParamSet] = ParamSet.of(
        LR.replace(default=1e-3, doc="Adam learning rate", high=1.0,
                   presets={"paper": 1e-3, "paper_cifar10": 1e-3}),
        CLIP,
        ALPHA,
        K,
        Param("sigma_floor", paper_floor(sigma_0=10.0), "noise floor relative to sigma_0 (Eq. 7 "
              "with Table 1's sigma_0)", low=0.0, high=1.0,
              presets={"paper": paper_floor(sigma_0=10.0),
                       "paper_cifar10": paper_floor(sigma_0=6.0)}),
        Param("public_batch_size", 64, "public examples per importance refresh", low=1,
              modes=("public",), role="setting"),
        public_every("refresh_every", what="the layer importances"),
    )
    fast_lifecycle: ClassVar[dict[str, Any]] = {"refresh_every": 2, "k": 1.0}

    # ---- class-level hooks ----------------------------------------------------------------
    @classmethod
    def noise_shape(cls, *, epochs: int, steps_per_epoch: int,
                    params: Mapping[str, Any]) -> Schedule:
        """One phase per epoch at max(1/(1+k t), floor); equal neighbours (the floor's plateau,
        or k = 0) merge, so the accountant composes one mechanism per distinct sigma_t."""
        p = cls.validate_params(params)
        shape = decay_shape(epochs=epochs, k=float(p["k"]), floor=float(p["sigma_floor"]))
        return Schedule.of(Phase(noise_multiplier=m, steps=steps_per_epoch)
                           for m in shape).merged()

    # ---- construction ---------------------------------------------------------------------
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.alpha = float(self.params["alpha"])
        self.sizes = [max(n, 1) for n in self.model.layer_sizes()]
        uniform = self.clip_norm / math.sqrt(self.num_layers)
        self.bounds: list[float] = [uniform] * self.num_layers  # C_j (sound modes)
        self.refreshed_at: int | None = None  # public mode: step of the last refresh
        self.faithful_s: list[float] = [0.0] * self.num_layers  # s_j of the current batch
        self.thresholds = _THRESHOLDS_FROM[self.mode.sources[THRESHOLD_STAT]]()
        if self.mode.sources[THRESHOLD_STAT] is Source.PUBLIC:
            self.public_refresh_every = self.refresh_period(
                self.params["refresh_every"], public_batch=int(self.params["public_batch_size"]))

    # ---- thresholds -----------------------------------------------------------------------
    def set_bounds(self, importance: list[float]) -> None:
        """C_j proportional to alpha * h_j with sqrt(sum C_j^2) = C (alpha cancels here).

        Zero, NaN or infinite importances fall back to the floor share; all-zero gives uniform.
        """
        j = self.num_layers
        s = [self.alpha * h if math.isfinite(h) and h > 0 else 0.0 for h in importance]
        top = max(s)
        if not (math.isfinite(top) and top > 0):
            w = [1.0] * j
        else:
            w = [x / top for x in s]  # divide first: no overflow in the squares
            norm = math.sqrt(sum(x * x for x in w))
            w = [max(x / norm, MIN_SHARE / math.sqrt(j)) for x in w]
        norm = math.sqrt(sum(x * x for x in w))
        self.bounds = [self.clip_norm * x / norm for x in w]

    def layer_rms(self, tensors: dict[str, torch.Tensor]) -> list[float]:
        """||block_j|| / sqrt(n_j) per layer: the paper's importance of each layer."""
        first = next(iter(tensors.values()))
        sq = torch.zeros(self.num_layers, dtype=torch.float64, device=first.device)
        for n, g in tensors.items():
            sq[self.layer_of[n]] += g.detach().double().pow(2).sum()
        norms = sq.sqrt().tolist()  # one host read per call: a refresh, or a lagged release
        return [h / math.sqrt(n) for h, n in zip(norms, self.sizes, strict=True)]

    def public_importance(self) -> list[float]:
        """One ordinary (not per-example) backward pass on a public batch: no privacy cost."""
        x, y = self.public_batch(int(self.params["public_batch_size"]))
        named = list(self.model.named_parameters())
        with torch.enable_grad():
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        return self.layer_rms({n: g for (n, _), g in zip(named, grads, strict=True)
                               if g is not None})

    # ---- phases (delegated to the thresholds' source) -------------------------------------
    def begin_step(self, step: int) -> None:
        self.thresholds.before_step(self, step)

    def sensitivity(self) -> float:
        return self.thresholds.sensitivity(self)

    def layer_bounds(self) -> list[float] | None:
        return self.thresholds.layer_bounds(self)

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """coef_ij = min(1, C_j / ||g_ij||) (the sound modes' per-example rule)."""
        bounds = self.device_constant("clip_bounds", self.bounds, device=norms.device,
                                      dtype=norms.dtype)
        return (bounds / (norms + NORM_EPS)).clamp(max=1.0)

    def clip(self, view: PerExampleView) -> dict[str, torch.Tensor]:
        return self.thresholds.clip(self, view)

    def noise_std(self) -> list[float]:
        return self.thresholds.noise_std(self, self.sigma_at(self.step_count))

    def whitened_noise_multiplier(self) -> float:
        """Sound modes: the base's whitening over ``layer_bounds`` (exactly sigma_t).

        Faithful mode has no sensitivity bound to whiten by; the ledger records the paper's
        claimed multiplier sigma_t (under its own per-layer bounds s_j sqrt(n_j) the whitened
        multiplier would even be sigma_t / sqrt(J), as the paper composes layers in parallel).
        """
        if self.layer_bounds() is None:
            return self.sigma_at(self.step_count)
        return super().whitened_noise_multiplier()

    def end_step(self, noisy: dict[str, torch.Tensor]) -> None:
        self.thresholds.after_release(self, noisy)

    # ---- reporting ------------------------------------------------------------------------
    def current_thresholds(self) -> list[float]:
        return self.bounds if self.layer_bounds() is not None else self.faithful_s

    def epoch_metrics(self) -> dict[str, float]:
        thresholds = self.current_thresholds()
        return {
            **super().epoch_metrics(),
            "sigma_t": self.sigma_at(max(self.step_count - 1, 0)),
            "threshold_min": min(thresholds),
            "threshold_max": max(thresholds),
            **{f"threshold_{name}": t
               for name, t in zip(self.model.layer_names, thresholds, strict=True)},
        }

    def extra_record(self) -> dict[str, Any]:
        sigma_0 = self.noise_schedule.first
        floor = float(self.params["sigma_floor"])
        sound = self.layer_bounds() is not None
        return {
            "alpha": self.alpha,
            "alpha_role": ("cancels: thresholds are normalised to sqrt(sum C_j^2) = C" if sound
                           else "coordinate threshold = alpha x layer RMS gradient"),
            "k": float(self.params["k"]),
            "sigma_floor": floor,
            "sigma_floor_is": "relative to sigma_0",
            "sigma_floor_absolute": floor * sigma_0,
            "public_batch_size": int(self.params["public_batch_size"]),
            "refresh_every": self.public_refresh_every,
            "layer_noise_std": "sigma_t * C_j * sqrt(J)" if sound else "sigma_t * s_j * sqrt(n_j)",
            "thresholds": list(self.current_thresholds()),
        }

    # ---- checkpointing --------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "refreshed_at": self.refreshed_at,
                "faithful_s": list(self.faithful_s)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.bounds = [float(c) for c in state["bounds"]]
        self.refreshed_at = (None if state["refreshed_at"] is None
                             else int(state["refreshed_at"]))
        self.faithful_s = [float(s) for s in state["faithful_s"]]
