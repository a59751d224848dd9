"""ww_dpsgd — DP-SGD with spectral-feedback clipping control (papers/ww-dp-sgd..., WW-DP-SGD).

Every K steps the controller reads the probe layer's weight (conv kernels reshaped to
C_out x C_in*kh*kw), fits the power-law tail exponent zeta of its eigenvalues lambda = s^2
(:mod:`trainables.spectral`; several probe layers -> the median of their zetas), smooths it,
zeta^ = beta zeta^ + (1 - beta) zeta, and moves the clipping norm in the log domain:
e = zeta^ - zeta_star; u = log C; u += kappa * clip(e / radius, -1, 1); C = exp(u), clamped to
[C_min, C_max]. Between probes C is held, so C_t changes only at multiples of K.

Privacy argument: C_t is a function of the weights theta_t, which are outputs of the earlier
(already accounted) steps, and of fixed hyperparameters; it never reads data, per-example
gradients or batch statistics, so choosing it is post-processing. Conditioned on the past,
step t clips each example's gradient to L2 norm <= C_t (flat clipping) and adds
N(0, sigma^2 C_t^2 I): ``self.clip_norm`` is set to C_t before the step, and the base's
sensitivity, clipping and noise all read it, so the noise-to-sensitivity ratio is sigma at
every step whatever C_t is. Each step is therefore the Poisson-subsampled Gaussian mechanism
with multiplier sigma, composed adaptively over the steps exactly as plain DP-SGD (the paper's
Lemma 4.1 / Theorem 4.2). The controller's hyperparameters and the clamp never enter the
accountant.

Choices where the paper is loose (DESIGN.md rules where they differ):

* u = log C of the *clamped* C before each update (DESIGN's order; Eq. 9 defines u_t = log C_t),
  so a clamp hit does not wind the log state up beyond the bounds.
* zeta^ starts at the first probe's zeta (``ema_init="first"``) by default: the paper's
  zeta^_0 = zeta_star (Algorithm 1, line 6; ``ema_init="target"``, used by the "paper" preset)
  biases zeta^ towards the zone centre for ~1/(1-beta) probes and mutes the controller for most
  of a short trial.
* Several probe layers: DESIGN's median of the raw zetas, then one EMA (the paper, Sec. 8.2,
  takes the median of per-layer EMAs).
* The clamp is relative to C_0 by default, C in [c_min * C_0, c_max * C_0], so a sweep over
  C_0 keeps its meaning; ``clamp="absolute"`` is the paper's form, ``"none"`` disables it. As
  in the paper (Alg. 1, line 21), the clamp acts at probes, so C_0 itself is never altered.
* A probe whose fit fails (e.g. non-finite weights) holds C and zeta^, the paper's carry-over.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from core.errors import UserInputError
from trainables.dp_step import DPStep
from trainables.methods import register
from trainables.spectral import KS_MIN_EIGS, MIN_TAIL, TOP_K_FRACTION, weight_tail_exponent

#: ``probe_layers`` values that name a rule instead of layers.
FIRST_DENSE = "first_dense"
ALL_LAYERS = "all"
CLAMP_MODES = ("relative", "absolute", "none")
EMA_INITS = ("first", "target")
#: Modules whose weight a probe can read.
_Weighted = nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d


def _weight_module(block: nn.Module) -> _Weighted | None:
    """The block's Linear or Conv module (a layer is one of them plus activation / pooling)."""
    for module in block.modules():
        if isinstance(module, _Weighted):
            return module
    return None


def _number(params: dict[str, Any], key: str, *, allowed: str,
            ok: Callable[[float], bool]) -> float:
    """``params[key]`` as a float if it is a finite real number (not a bool) passing ``ok``."""
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserInputError(field=f"method_params.{key}", value=value, allowed=allowed)
    if not ok(float(value)):
        raise UserInputError(field=f"method_params.{key}", value=value, allowed=allowed)
    return float(value)


@register
class WWDPSGD(DPStep):
    name: ClassVar[str] = "ww_dpsgd"
    extra_params: ClassVar[dict[str, Any]] = {
        # controller gain per probe, in log C units (paper: kappa > 0; Table 13's "small" 0.05
        # and "large" 0.30 bracket its unstated default, taken as 0.1)
        "kappa": 0.1,
        # health-zone centre and radius (paper Eq. 6-7 and Sec. 5.5: zone (2, 6) = 4 +- 2)
        "zeta_star": 4.0,
        "radius": 2.0,
        # EMA factor: DESIGN's 0.9-0.98; 0.95 = the paper's checklist floor (beta >= 0.95)
        "beta": 0.95,
        # probe period in steps (paper Sec. 5.5: K in {10, 50, 100}; 50 in Sec. 8.2)
        "K": 50,
        # clamp: factors of C_0 by default; the paper's wider clamp [0.3, 5.0] (Table 13, C_0=1)
        "clamp": "relative",
        "c_min": 0.3,
        "c_max": 5.0,
        # "first_dense" (DESIGN; the paper's fc1, Table 13), "all" (median over every layer,
        # the paper's "full" probe, Sec. 8.2), one layer name or a list of names
        "probe_layers": FIRST_DENSE,
        # zeta^ before the first probe: "first" (the first zeta) or "target" (zeta_star, paper)
        "ema_init": "first",
    }
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {
            "clip_norm": 1.0,  # C_0 = 1 (Table 11's centre; the clamp [1, 3] starts there)
            "kappa": 0.1,  # not stated; between Table 13's "small" 0.05 and "large" 0.30
            "zeta_star": 4.0,  # Eq. 7, Sec. 5.5, Table 12 default
            "radius": 2.0,  # Eq. 7, Sec. 5.5, Table 12 default
            "beta": 0.98,  # Table 7 "default beta = 0.98"
            "K": 50,  # Sec. 8.2 "probe period K = 50"
            "clamp": "absolute",  # Sec. 8.2 "clamp bounds C_min = 1, C_max = 3"
            "c_min": 1.0,
            "c_max": 3.0,
            "probe_layers": FIRST_DENSE,  # fc1 (Table 13 / Sec. 8.4.2 "probes the fc1 layer")
            "ema_init": "target",  # Algorithm 1, line 6: zeta^_0 = zeta_star
        },
    }

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        p = super().validate_params(params)
        p["kappa"] = _number(p, "kappa", allowed="a finite number > 0 (log-C step per probe)",
                             ok=lambda v: v > 0)
        p["zeta_star"] = _number(p, "zeta_star", ok=lambda v: v > 1,
                                 allowed="a finite number > 1 (a power-law tail exponent)")
        p["radius"] = _number(p, "radius", allowed="a finite number > 0", ok=lambda v: v > 0)
        p["beta"] = _number(p, "beta", allowed="a number in [0, 1) (EMA factor)",
                            ok=lambda v: 0 <= v < 1)
        k = p["K"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UserInputError(field="method_params.K", value=k,
                                 allowed="an integer >= 1 (probe period in steps)")
        if p["clamp"] not in CLAMP_MODES:
            raise UserInputError(field="method_params.clamp", value=p["clamp"],
                                 allowed=f"one of {CLAMP_MODES}")
        p["c_min"] = _number(p, "c_min", allowed="a finite number > 0", ok=lambda v: v > 0)
        p["c_max"] = _number(p, "c_max", allowed=f"a finite number > c_min = {p['c_min']}",
                             ok=lambda v: v > p["c_min"])
        if p["clamp"] == "relative" and not p["c_min"] <= 1 <= p["c_max"]:
            raise UserInputError(field="method_params.c_min", value=[p["c_min"], p["c_max"]],
                                 allowed="relative clamp factors with c_min <= 1 <= c_max "
                                         "(the range must contain C_0)")
        if p["ema_init"] not in EMA_INITS:
            raise UserInputError(field="method_params.ema_init", value=p["ema_init"],
                                 allowed=f"one of {EMA_INITS}")
        p["probe_layers"] = cls._check_probe_spec(p["probe_layers"])
        return p

    @staticmethod
    def _check_probe_spec(value: Any) -> str | list[str]:
        allowed = (f"{FIRST_DENSE!r}, {ALL_LAYERS!r}, a layer name or a non-empty list of "
                   "distinct layer names")
        if isinstance(value, str):
            return value if value in (FIRST_DENSE, ALL_LAYERS) else [value]
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(v, str) for v in value) or len(set(value)) != len(value)):
            raise UserInputError(field="method_params.probe_layers", value=value,
                                 allowed=allowed)
        return list(value)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        p = self.params
        self.c0 = self.clip_norm
        self.period = int(p["K"])
        probes = self._resolve_probes(p["probe_layers"])
        self.probe_names = [name for name, _ in probes]
        self._probe_weights = [module.weight for _, module in probes]
        if p["clamp"] == "relative":
            self.c_lo, self.c_hi = p["c_min"] * self.c0, p["c_max"] * self.c0
        elif p["clamp"] == "absolute":
            self.c_lo, self.c_hi = p["c_min"], p["c_max"]
        else:
            self.c_lo, self.c_hi = 0.0, math.inf
        self.zeta_hat: float | None = p["zeta_star"] if p["ema_init"] == "target" else None
        self.traj: dict[str, list[float]] = {key: [] for key in self._traj_keys()}

    def _resolve_probes(self, spec: str | list[str]) -> list[tuple[str, _Weighted]]:
        """(name, weight module) of each probe layer, checked against the model's layers."""
        weighted: dict[str, _Weighted] = {}
        for name in self.model.layer_names:
            module = _weight_module(self.model.blocks[name])
            if module is not None:
                weighted[name] = module
        if spec == FIRST_DENSE:
            dense = [(n, m) for n, m in weighted.items() if isinstance(m, nn.Linear)]
            if not dense:
                raise UserInputError(field="method_params.probe_layers", value=spec,
                                     allowed=f"layer names (this model has no dense layer): "
                                             f"{list(weighted)}")
            return dense[:1]
        if spec == ALL_LAYERS:
            return list(weighted.items())
        bad = [n for n in spec if n not in weighted]
        if bad:
            raise UserInputError(field="method_params.probe_layers", value=bad,
                                 allowed=f"names of layers with a Linear or Conv weight: "
                                         f"{list(weighted)}")
        return [(n, weighted[n]) for n in spec]

    def _traj_keys(self) -> list[str]:
        return ["step", "clip_norm", "zeta_hat", "zeta", "clamp",
                *(f"zeta:{n}" for n in self.probe_names)]

    # ---- the controller -----------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Probe and update C before steps K, 2K, ... (i.e. after step t with (t+1) % K == 0)."""
        if step > 0 and step % self.period == 0 and (not self.traj["step"]
                                                     or self.traj["step"][-1] != step):
            self._probe(step)

    def _probe(self, step: int) -> None:
        zetas = []
        for w in self._probe_weights:
            fit = weight_tail_exponent(w.detach().to("cpu", torch.float64).numpy())
            zetas.append(fit.zeta)
        finite = [z for z in zetas if math.isfinite(z)]
        zeta = statistics.median(finite) if finite else math.nan
        clamp = 0.0
        if finite:
            p = self.params
            beta = p["beta"]
            self.zeta_hat = zeta if self.zeta_hat is None else (
                beta * self.zeta_hat + (1.0 - beta) * zeta)
            e = self.zeta_hat - p["zeta_star"]
            u = math.log(self.clip_norm) + p["kappa"] * min(1.0, max(-1.0, e / p["radius"]))
            c = math.exp(min(max(u, -700.0), 700.0))  # stays a positive float even unclamped
            if c >= self.c_hi:
                c, clamp = self.c_hi, 1.0
            elif c <= self.c_lo:
                c, clamp = self.c_lo, -1.0
            self.clip_norm = c
        t = self.traj
        t["step"].append(step)
        t["clip_norm"].append(self.clip_norm)
        t["zeta_hat"].append(math.nan if self.zeta_hat is None else self.zeta_hat)
        t["zeta"].append(zeta)
        t["clamp"].append(clamp)
        for name, z in zip(self.probe_names, zetas, strict=True):
            t[f"zeta:{name}"].append(z)

    # ---- logging ------------------------------------------------------------------------
    def epoch_metrics(self) -> dict[str, float]:
        return {"clip_norm": self.clip_norm,
                "zeta_hat": math.nan if self.zeta_hat is None else self.zeta_hat}

    def trajectories(self) -> dict[str, list[float]]:
        """One entry per probe: the step it preceded, C after it, zeta^, raw zetas, clamp hit
        (+1 at C_max, -1 at C_min, 0 otherwise)."""
        return {key: list(values) for key, values in self.traj.items()}

    def extra_record(self) -> dict[str, Any]:
        hits = self.traj["clamp"]
        return {
            "probe_layers": list(self.probe_names),
            "clip_norm_0": self.c0,
            "clip_norm_final": self.clip_norm,
            "clamp": self.params["clamp"],
            "clip_norm_bounds": (None if self.params["clamp"] == "none"
                                 else [self.c_lo, self.c_hi]),
            "ema_init": self.params["ema_init"],
            "probes": len(self.traj["step"]),
            "clamp_hits": {"min": sum(h < 0 for h in hits), "max": sum(h > 0 for h in hits)},
            "estimator": (f"continuous power-law MLE, lambda_min by minimal KS distance "
                          f"(tails >= {MIN_TAIL}); top {TOP_K_FRACTION:g} of the spectrum "
                          f"below {KS_MIN_EIGS} eigenvalues"),
        }

    # ---- checkpointing ------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, "zeta_hat": self.zeta_hat,
                "trajectories": {key: list(values) for key, values in self.traj.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.clip_norm = float(state["clip_norm"])
        self.zeta_hat = None if state["zeta_hat"] is None else float(state["zeta_hat"])
        saved = state["trajectories"]
        if set(saved) != set(self.traj):
            raise ValueError(f"checkpointed trajectories {sorted(saved)} do not match the "
                             f"probe layers {self.probe_names}")
        self.traj = {key: list(saved[key]) for key in self._traj_keys()}
