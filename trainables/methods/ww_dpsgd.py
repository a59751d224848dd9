"""ww_dpsgd — DP-SGD with spectral-feedback clipping control (Partohaghighi, Marcia, West &
Chen, "When Gradient Clipping Becomes a Control Mechanism for Differential Privacy in Deep
Learning").

Every K steps the controller reads the probe layer's weight (conv kernels reshaped to
C_out x C_in*kh*kw), fits the power-law tail exponent zeta of its eigenvalues lambda = s^2
(:mod:`trainables.dp.spectral`; several probe layers -> the median of their zetas), smooths it,
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

Choices where the paper is loose (``docs/methods.md`` gives the reasons):

* u = log C of the *clamped* C before each update (Eq. 9 defines u_t = log C_t), so a clamp
  hit does not wind the log state up beyond the bounds.
* zeta^ starts at the first probe's zeta (``ema_init="first"``) by default: the paper's
  zeta^_0 = zeta_star (Algorithm 1, line 6; ``ema_init="target"``, used by the "paper" preset)
  biases zeta^ towards the zone centre for ~1/(1-beta) probes and mutes the controller for most
  of a short trial.
* Several probe layers: the median of the raw zetas, then one EMA (the paper, Sec. 8.2, takes
  the median of per-layer EMAs).
* The clamp is relative to C_0 by default, C in [c_min * C_0, c_max * C_0], so a sweep over
  C_0 keeps its meaning; ``clamp="absolute"`` is the paper's form, ``"none"`` disables it. As
  in the paper (Alg. 1, line 21), the clamp acts at probes, so C_0 itself is never altered.
* A probe whose fit fails (e.g. non-finite weights) holds C and zeta^, the paper's carry-over.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any, ClassVar

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.core.modes import Mode, Source
from dpsweep.core.params import Constraint, Param, ParamSet
from dpsweep.reports.series import LoggedSeries, Panel, SeriesLine, SummaryColumn, Zone
from dpsweep.trainables.dp.contract import CLIP, LR, MOMENTUM
from dpsweep.trainables.dp.spectral import (
    KS_MIN_EIGS,
    MIN_TAIL,
    TOP_K_FRACTION,
    weight_tail_exponent,
)
from dpsweep.trainables.dp.step import DPStep
from dpsweep.trainables.methods import register

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")

#: ``probe_layers`` values that name a rule instead of layers.
FIRST_DENSE = "first_dense"
ALL_LAYERS = "all"
#: Largest |log C| the controller may reach unclamped (C stays a positive finite float).
MAX_LOG_C = 700.0


def _probe_spec(value: Any) -> str | list[str]:
    """A rule name, one layer name or a non-empty list of distinct layer names."""
    if isinstance(value, str):
        return value if value in (FIRST_DENSE, ALL_LAYERS) else [value]
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(v, str) for v in value) or len(set(value)) != len(value)):
        raise ValueError
    return list(value)


def _weight_module(block: nn.Module) -> nn.Module | None:
    """The block's Linear or Conv module (a layer is one of them plus activation / pooling)."""
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    for module in block.modules():
        if isinstance(module, kinds):
            return module
    return None


#: The controller gain (searched: search_spaces/ww_dpsgd.py).
KAPPA = Param("kappa", 0.1, "controller gain per probe, in log C units (paper: Table 13's "
              "'small' 0.05 and 'large' 0.30 bracket its unstated default)", low=0.0,
              low_open=True, high=10.0, log=True, presets={"paper": 0.1})
#: The target tail exponent (searched: search_spaces/ww_dpsgd.py).
ZETA_STAR = Param("zeta_star", 4.0, "target tail exponent, centre of the health zone (Eq. 6-7)",
                  low=1.0, low_open=True, high=50.0, presets={"paper": 4.0})


@register
class WWDPSGD(DPStep):
    name: ClassVar[str] = "ww_dpsgd"
    summary: ClassVar[str] = ("clipping norm C_t steered every K steps by the tail exponent of "
                              "the probe layer's weight spectrum (post-processing)")
    citation: ClassVar[str] = ("Partohaghighi, Marcia, West & Chen, When Gradient Clipping "
                               "Becomes a Control Mechanism for Differential Privacy in Deep "
                               "Learning")
    argument: ClassVar[str] = (
        "C_t is computed from the released weights only (post-processing); conditioned on the "
        "past each step clips to C_t and adds N(0, sigma^2 C_t^2), so every step is the "
        "Poisson-subsampled Gaussian mechanism with multiplier sigma, as in DP-SGD.")
    modes: ClassVar[tuple[Mode, ...]] = (
        Mode("standard", {"clipping norm C_t": Source.RELEASED}),)
    params: ClassVar[ParamSet] = ParamSet.of(
        LR,
        CLIP.replace(doc="initial clipping norm C_0 (the controller moves C_t from it)",
                     presets={"paper": 1.0}),  # Table 11's centre; the clamp [1, 3] starts there
        MOMENTUM,
        KAPPA,
        ZETA_STAR,
        Param("radius", 2.0, "health-zone radius (Eq. 7, Sec. 5.5: zone (2, 6) = 4 +- 2)",
              low=0.0, low_open=True, high=50.0, role="setting", presets={"paper": 2.0}),
        Param("beta", 0.95, "EMA factor of zeta (0.95 = the paper's checklist floor; Table 7 "
              "default 0.98)", low=0.0, high=1.0, high_open=True, role="setting",
              presets={"paper": 0.98}),
        Param("K", 50, "probe period in steps (Sec. 5.5: 10, 50, 100; Sec. 8.2: 50)", low=1,
              role="setting", presets={"paper": 50}),
        Param("clamp", "relative", "clamp of C_t: 'relative' to C_0, 'absolute' (the paper's), "
              "or 'none'", choices=("relative", "absolute", "none"), role="setting",
              presets={"paper": "absolute"}),
        Param("c_min", 0.3, "lower clamp (a factor of C_0 when relative; Sec. 8.2: C_min 1)",
              low=0.0, low_open=True, high=1e4, role="setting", presets={"paper": 1.0}),
        Param("c_max", 5.0, "upper clamp (a factor of C_0 when relative; Sec. 8.2: C_max 3)",
              low=0.0, low_open=True, high=1e4, role="setting", presets={"paper": 3.0}),
        Param("probe_layers", FIRST_DENSE, "'first_dense' (the paper's fc1), 'all' (median "
              "over every layer, Sec. 8.2's 'full' probe), a layer name or a list of names",
              kind="any", rule=_probe_spec, role="setting",
              allowed_text=f"{FIRST_DENSE!r}, {ALL_LAYERS!r}, a layer name or a non-empty list "
                           "of distinct layer names", presets={"paper": FIRST_DENSE}),
        Param("ema_init", "first", "zeta^ before the first probe: 'first' (the first zeta) or "
              "'target' (zeta_star, Algorithm 1 line 6)", choices=("first", "target"),
              role="setting", presets={"paper": "target"}),
        constraints=(
            Constraint("c_max", lambda p: p["c_max"] > p["c_min"],
                       "a number > c_min (the clamp's upper end above its lower end)"),
            Constraint("c_min", lambda p: p["clamp"] != "relative"
                       or p["c_min"] <= 1.0 <= p["c_max"],
                       "relative clamp factors with c_min <= 1 <= c_max (the range must contain "
                       "C_0)"),
        ),
    )
    fast_lifecycle: ClassVar[dict[str, Any]] = {"K": 3, "kappa": 0.5}
    #: The controller's log (``trajectories``), on the report: C_t from C_0 (the results
    #: store's ``clip_norm``) and zeta^ against the health zone.
    report_series: ClassVar[LoggedSeries | None] = LoggedSeries(
        label="WW-DP-SGD", name="ww_trajectories",
        caption="WW-DP-SGD clipping norm and tail exponent trajectories",
        panels=(Panel(title="clipping norm C_t", ylabel="clipping norm C_t",
                      lines=(SeriesLine("clip_norm", style="held", start="clip_norm"),)),
                Panel(title="zeta^ (solid), raw zeta (dotted), zone zeta* ± radius",
                      ylabel="tail exponent",
                      lines=(SeriesLine("zeta_hat"), SeriesLine("zeta", style="faint")),
                      zone=Zone(centre="zeta_star", radius="radius"))),
        columns=(SummaryColumn("clip_norm", "C_0", "start"),
                 SummaryColumn("clip_norm", "final C", "last"),
                 SummaryColumn("clip_norm", "C range", "range"),
                 SummaryColumn("zeta_hat", "final zeta^", "last", digits=3),
                 SummaryColumn("clamp", "clamp hits", "hits")),
        covered_note="Computed from the released noisy updates (post-processing): covered by "
                     "epsilon.",
        count_label="probes")

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

    def _resolve_probes(self, spec: str | list[str]) -> list[tuple[str, nn.Module]]:
        """(name, weight module) of each probe layer, checked against the model's layers."""
        weighted: dict[str, nn.Module] = {}
        for name in self.model.layer_names:
            block = self.model.blocks.get(name)  # none for a parameter that is a layer
            module = None if block is None else _weight_module(block)
            if module is not None:
                weighted[name] = module
        if spec == FIRST_DENSE:
            dense = [(n, m) for n, m in weighted.items() if isinstance(m, torch.nn.Linear)]
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
        # The step's one host read, at probes only (every K steps): the spectral fit runs in
        # NumPy on the host, and C_t must be a host number (it scales the noise and is
        # recorded). Between probes the step reads nothing.
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
            c = math.exp(min(max(u, -MAX_LOG_C), MAX_LOG_C))  # positive and finite unclamped
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
