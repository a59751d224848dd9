"""dp_adamilg — importance-based layer-wise clipping and noise, decaying noise, Adam
(papers/dp-adamilg...).

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
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from core.errors import UserInputError
from trainables.dp_step import _NORM_EPS, DPStep, NoisePhase, PerExampleGrads
from trainables.methods import register

MODES = ("public", "lagged", "faithful")

#: Smallest share of the budget any layer keeps, as a fraction of the uniform share C/sqrt(J):
#: a layer whose importance is zero (or NaN) is never starved, and nothing divides by zero.
MIN_SHARE = 0.01


def paper_floor(*, sigma_0: float, delta: float = 1e-5, epsilon_lim: float = 1.0) -> float:
    """The paper's floor sigma_* (Eq. 7) relative to its sigma_0 (Table 1).

    The paper gives no value for epsilon_Lim, only that it lies in (0, 1); epsilon_Lim = 1 is
    the edge of that range and gives the lowest floor the paper allows.
    """
    return math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon_lim / sigma_0


def decay_shape(*, epochs: int, k: float, floor: float) -> list[float]:
    """Relative multiplier of each epoch t = 0, 1, ...: max(1 / (1 + k t), floor).

    t counts from 0 so that sigma_0 is the first epoch's multiplier (DESIGN.md's form; the
    paper's Algorithm 1 loops from t = 1 but calls sigma_0 the initial scale).
    """
    return [max(1.0 / (1.0 + k * t), floor) for t in range(epochs)]


@register
class DPAdamILG(DPStep):
    name: ClassVar[str] = "dp_adamilg"
    optimizer_name: ClassVar[str] = "adam"
    extra_params: ClassVar[dict[str, Any]] = {
        "mode": "public",
        "alpha": 1.2,  # Table 1 (all datasets); cancels in the sound modes (module docstring)
        "k": 0.05,  # Table 1, MNIST / FMNIST
        "sigma_floor": paper_floor(sigma_0=10.0),  # Eq. 7 with Table 1's MNIST sigma_0
        # public mode: size of the importance batch. 64 keeps the step within 1.2x DP-SGD's
        # at batch 256 on cnn28 (the one ordinary pass costs ~0.1 ms per example on a CPU)
        "public_batch_size": 64,
        "refresh_every": 4,  # public mode: steps between importance refreshes (speed: 1.2x target)
    }
    # Table 1: alpha = 1.2 everywhere; k = 0.05 and sigma_0 = 10 for MNIST / FMNIST, k = 0.001
    # and sigma_0 = 6 for CIFAR-10/100 and SVHN; the floor is Eq. 7 at delta = 1e-5 (Sec. 5.1)
    # relative to that sigma_0. The paper states no learning rate; lr is Adam's own default
    # (Kingma & Ba, 2014, which the paper cites for its update). No per-example C exists in
    # the paper, so clip_norm is left to the sweep.
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {"alpha": 1.2, "k": 0.05, "sigma_floor": paper_floor(sigma_0=10.0),
                  "lr": 1e-3},
        "paper_cifar10": {"alpha": 1.2, "k": 0.001, "sigma_floor": paper_floor(sigma_0=6.0),
                          "lr": 1e-3},
    }

    # ---- class-level hooks ----------------------------------------------------------------
    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        p = super().validate_params(params)
        if p["mode"] not in MODES:
            raise UserInputError(field="method_params.mode", value=p["mode"],
                                 allowed=f"one of {MODES}")
        _check_number(p, "alpha", allowed="a finite number > 0", ok=lambda x: x > 0)
        _check_number(p, "k", allowed="a finite number >= 0 (decay rate per epoch)",
                      ok=lambda x: x >= 0)
        _check_number(p, "sigma_floor", allowed="a number in [0, 1] (fraction of sigma_0)",
                      ok=lambda x: 0 <= x <= 1)
        for key in ("public_batch_size", "refresh_every"):
            v = p[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserInputError(field=f"method_params.{key}", value=v,
                                     allowed="an integer >= 1")
        return p

    @classmethod
    def noise_shape(cls, *, epochs: int, steps_per_epoch: int,
                    params: dict[str, Any]) -> list[NoisePhase]:
        """One phase per epoch at max(1/(1+k t), floor); equal neighbours (the floor's plateau,
        or k = 0) merge, so the accountant composes one mechanism per distinct sigma_t."""
        p = cls.validate_params(params)
        phases: list[NoisePhase] = []
        for m in decay_shape(epochs=epochs, k=float(p["k"]), floor=float(p["sigma_floor"])):
            if phases and phases[-1].noise_multiplier == m:
                phases[-1] = NoisePhase(noise_multiplier=m,
                                        steps=phases[-1].steps + steps_per_epoch)
            else:
                phases.append(NoisePhase(noise_multiplier=m, steps=steps_per_epoch))
        return phases

    # ---- construction ---------------------------------------------------------------------
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mode: str = self.params["mode"]
        self.alpha = float(self.params["alpha"])
        self._sizes = [max(n, 1) for n in self.model.layer_sizes()]
        uniform = self.clip_norm / math.sqrt(self.num_layers)
        self._bounds: list[float] = [uniform] * self.num_layers  # C_j (sound modes)
        self._refreshed_at: int | None = None  # public mode: step of the last refresh
        self._faithful_s: list[float] = [0.0] * self.num_layers  # s_j of the current batch

    # ---- validity -------------------------------------------------------------------------
    @property
    def dp_valid(self) -> bool:
        return self.mode != "faithful"

    @property
    def validity_reason(self) -> str:
        if self.mode == "faithful":
            return ("epsilon claim invalid: the batch gradient is clipped at thresholds taken "
                    "from itself and noised in proportion to its own norm, so no per-example "
                    "sensitivity bound exists; the reported epsilon is the PRV epsilon of the "
                    "paper's multipliers sigma_t")
        source = ("a public shadow batch at the current weights" if self.mode == "public"
                  else "the previous released noisy gradient (post-processing)")
        return (f"per-example per-layer clipping at C_j with sqrt(sum C_j^2) = C, thresholds "
                f"from {source}; layer noise sigma_t * C_j * sqrt(J) makes every step a "
                f"Gaussian mechanism with multiplier sigma_t; schedule composed by the accountant")

    # ---- thresholds -----------------------------------------------------------------------
    def _set_bounds(self, importance: list[float]) -> None:
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
        self._bounds = [self.clip_norm * x / norm for x in w]

    def _layer_rms(self, tensors: dict[str, torch.Tensor]) -> list[float]:
        """||block_j|| / sqrt(n_j) per layer: the paper's importance of each layer."""
        first = next(iter(tensors.values()))
        sq = torch.zeros(self.num_layers, dtype=torch.float64, device=first.device)
        for n, g in tensors.items():
            sq[self.layer_of[n]] += g.detach().double().pow(2).sum()
        norms = sq.sqrt().tolist()  # one device sync per call
        return [h / math.sqrt(n) for h, n in zip(norms, self._sizes, strict=True)]

    def _public_importance(self) -> list[float]:
        """One ordinary (not per-example) backward pass on a public batch: no privacy cost."""
        x, y = self.public_batch(int(self.params["public_batch_size"]))
        named = list(self.model.named_parameters())
        with torch.enable_grad():
            loss = F.cross_entropy(self.model(x), y)
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        return self._layer_rms({n: g for (n, _), g in zip(named, grads, strict=True)
                                if g is not None})

    # ---- phases ---------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if self.mode == "faithful":
            self._faithful_s = [0.0] * self.num_layers  # an empty batch releases no signal
        elif self.mode == "public" and (
                self._refreshed_at is None
                or step - self._refreshed_at >= int(self.params["refresh_every"])):
            self._set_bounds(self._public_importance())
            self._refreshed_at = step

    def sensitivity(self) -> float:
        return math.inf if self.mode == "faithful" else self.clip_norm

    def layer_bounds(self) -> list[float] | None:
        return None if self.mode == "faithful" else list(self._bounds)

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """coef_ij = min(1, C_j / ||g_ij||); faithful mode clips no example (all ones)."""
        if self.mode == "faithful":
            return torch.ones_like(norms)
        bounds = torch.tensor(self._bounds, dtype=norms.dtype, device=norms.device)
        return (bounds / (norms + _NORM_EPS)).clamp(max=1.0)

    def clip(self, grads: PerExampleGrads) -> dict[str, torch.Tensor]:
        if self.mode != "faithful":
            return super().clip(grads)
        # The paper clips the batch gradient. Thresholds are scale-equivariant, so clipping the
        # sum here equals the paper's clipping of the mean times the batch size.
        summed = {n: g.sum(dim=0) for n, g in grads.grads.items()}
        self._faithful_s = [self.alpha * h for h in self._layer_rms(summed)]
        return {n: s.clamp(-self._faithful_s[self.layer_of[n]],
                           self._faithful_s[self.layer_of[n]])
                for n, s in summed.items()}

    def noise_std(self) -> list[float]:
        sigma = self.sigma_at(self.step_count)
        if self.mode == "faithful":
            return [s * math.sqrt(n) * sigma
                    for s, n in zip(self._faithful_s, self._sizes, strict=True)]
        scale = sigma * math.sqrt(self.num_layers)
        return [scale * c for c in self._bounds]

    def whitened_noise_multiplier(self) -> float:
        """Sound modes: the base's whitening over ``layer_bounds`` (exactly sigma_t).

        Faithful mode has no sensitivity bound to whiten by; the ledger records the paper's
        claimed multiplier sigma_t (under its own per-layer bounds s_j sqrt(n_j) the whitened
        multiplier would even be sigma_t / sqrt(J), as the paper composes layers in parallel).
        """
        if self.mode == "faithful":
            return self.sigma_at(self.step_count)
        return super().whitened_noise_multiplier()

    def end_step(self, noisy: dict[str, torch.Tensor]) -> None:
        if self.mode == "lagged":
            self._set_bounds(self._layer_rms(noisy))

    # ---- reporting ------------------------------------------------------------------------
    def _thresholds(self) -> list[float]:
        return self._faithful_s if self.mode == "faithful" else self._bounds

    def epoch_metrics(self) -> dict[str, float]:
        thresholds = self._thresholds()
        return {
            **super().epoch_metrics(),
            "sigma_t": self.sigma_at(max(self.step_count - 1, 0)),
            "threshold_min": min(thresholds),
            "threshold_max": max(thresholds),
            **{f"threshold_{name}": t
               for name, t in zip(self.model.layer_names, thresholds, strict=True)},
        }

    def extra_record(self) -> dict[str, Any]:
        sigma_0 = self.noise_schedule[0].noise_multiplier
        floor = float(self.params["sigma_floor"])
        return {
            "mode": self.mode,
            "alpha": self.alpha,
            "alpha_role": ("cancels: thresholds are normalised to sqrt(sum C_j^2) = C"
                           if self.mode != "faithful"
                           else "coordinate threshold = alpha x layer RMS gradient"),
            "k": float(self.params["k"]),
            "sigma_floor": floor,
            "sigma_floor_is": "relative to sigma_0",
            "sigma_floor_absolute": floor * sigma_0,
            "public_batch_size": int(self.params["public_batch_size"]),
            "refresh_every": int(self.params["refresh_every"]),
            "layer_noise_std": ("sigma_t * s_j * sqrt(n_j)" if self.mode == "faithful"
                                else "sigma_t * C_j * sqrt(J)"),
            "thresholds": list(self._thresholds()),
        }

    # ---- checkpointing --------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"bounds": list(self._bounds), "refreshed_at": self._refreshed_at,
                "faithful_s": list(self._faithful_s)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self._bounds = [float(c) for c in state["bounds"]]
        self._refreshed_at = (None if state["refreshed_at"] is None
                              else int(state["refreshed_at"]))
        self._faithful_s = [float(s) for s in state["faithful_s"]]


def _check_number(p: dict[str, Any], key: str, *, allowed: str,
                  ok: Callable[[float], bool]) -> None:
    v = p[key]
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or not ok(v)):
        raise UserInputError(field=f"method_params.{key}", value=v, allowed=allowed)
