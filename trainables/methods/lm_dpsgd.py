"""lm_dpsgd — layer-wise MIA-risk-aware DP-SGD (Meng, Huang, Hou, Zheng & Chen, "Mitigating
Membership Inference in Intermediate Representations via Layer-wise MIA-risk-aware DP-SGD").

Stage 1 (:meth:`LMDPSGD.prepare`, once per sweep, public data only, cached on disk): a shadow
model of the trial's architecture is trained non-privately on half of the public shadow pool;
one membership attack per layer (an MLP on the layer's sorted IR values, see
trainables/audit/layer_attack.py) is fitted on the shadow model's IRs of its members and
non-members; the attack's balanced error rate ER(l) is the layer's risk estimate (lower = leakier).
ER is measured on held-out attack data by default, on the attack's own training data with ``er_eval
= "train"`` (the paper's Appendix B, line 31). The shadow model uses at most ``stage1_examples``
pool examples, half members, half non-members, and ``stage1_steps`` Adam steps: enough to overfit
(train accuracy ~0.98 vs test ~0.83 on Fashion-MNIST, 1.0 vs ~0.9 on digits) in seconds on one
thread.

Stage 2 (every step): with C_i = min(C, ||G_i||) and a unit weight vector w,
g^_i(l) = C_i * w(l) * g_i(l) / ||g_i(l)|| (0 for a zero block), so ||G^_i|| = C_i <= C, and
N(0, sigma^2 C^2 I) is added to the sum. ``weights = "risk"`` (paper Sec. 4.3):
w~(l) = u(l) * ER(l)^r, w = w~ / ||w~||, u(l) = mean_i ||g_i(l)|| / C_i. ``weights =
"bias_optimal"`` (Appendix D.2): w* minimises the clipping bias sum_l ||w(l) u_l - grad_l||^2
on the unit sphere (Lagrange multiplier found by bisection), then calibrated by ER^r and
renormalised like the risk rule (Sec. 4.3 frames the weights as bias-optimal then
risk-calibrated); r = 0 gives the paper's convergence-only variant of Fig. 3.

Privacy argument, per ``mode`` (where u, or the bias terms, come from):

* ``public`` (default, sound). u is computed from per-example gradients of a batch of the
  *public* shadow pool at the current weights, refreshed every ``u_every`` steps; ER comes from
  public data too. So w depends on no private example, every example's contribution has norm
  C_i <= C whatever the others are, removing one changes the sum by <= C, and the step is the
  Poisson-subsampled Gaussian mechanism with multiplier sigma (noise sigma * C per layer).
* ``lagged`` (sound). u comes from the previous step's *released* noisy gradient, which is
  post-processing of an output the accountant already paid for; the same sensitivity argument
  applies. The released block is w(l) times the clipped-direction mean plus noise, so its
  squared norm is debiased for the known noise energy n_l (sigma C / B)^2 and divided by the
  w(l)^2 that produced it (a ratio of exponential moving averages, ``lagged_beta``); without
  the division w would feed back on itself (w_t ~ w_{t-1} * ||u_l|| * ER^r) and collapse onto
  one layer. Until the first release u is uniform. What this estimates is Appendix D's
  ||u_l|| = ||mean_i C_i g_i(l) / ||g_i(l)|| ||, i.e. how well a layer's per-example
  directions agree, not the paper's mean norm share, which a release of layer-normalised
  blocks does not reveal; it favours small layers with aligned gradients (on digits_cnn most
  of the weight goes to conv1). ``bias_optimal`` needs the unclipped layer gradients, which a
  release does not reveal either, so it is not offered in this mode.
* ``faithful`` (epsilon claim INVALID). The paper's Algorithm 1: u is the mean over the
  *private* batch itself. Each example's own contribution is still C_i <= C, but w depends on
  every example in the batch, so replacing one example rescales the layer blocks of all the
  others: the sum moves by far more than C and no sensitivity bound exists. The paper's proof
  (Appendix C.1) only bounds the per-example norm. The trial is reported with the PRV epsilon
  of sigma, labelled invalid.

The ER used in the weights is clamped to [1e-3, 0.5]: a held-out error above 0.5 is estimation
noise around chance (it would otherwise reward a layer for the noise, amplified by ^r), and a
layer with ER = 0 keeps a small weight instead of never training again. The stored risk vector
is the raw one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.core.modes import Mode, Source
from dpsweep.core.params import Constraint, Param, ParamSet, is_real
from dpsweep.trainables.audit.risk_stage import MIN_STAGE1_EXAMPLES, Stage1
from dpsweep.trainables.dp.contract import CLIP, LR, MOMENTUM, public_every
from dpsweep.trainables.dp.step import DPStep, PerExampleView, example_norms
from dpsweep.trainables.methods import register

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

#: Range of ER used in the weights (module docstring); the stored risk vector is unclamped.
ER_MIN, ER_MAX = 1e-3, 0.5
#: lagged mode: u(l) is kept in [U_FLOOR * C, C] (||mean clipped direction|| <= C always).
U_FLOOR = 1e-2


# ---- weights -----------------------------------------------------------------------------
def unit(v: torch.Tensor) -> torch.Tensor:
    """v / ||v|| (float64), robust to overflow; uniform when v has no finite non-zero entry.
    Chosen on the device (no host read of whether v vanished)."""
    v = torch.where(torch.isfinite(v), v.double(), 0.0)
    top = v.abs().max()
    some = top > 0
    scaled = v / torch.where(some, top, 1.0)
    norm = scaled.norm()
    return torch.where(some, scaled / torch.where(norm > 0, norm, 1.0),
                       torch.full_like(v, 1.0 / math.sqrt(v.numel())))


def effective_risk(risk: torch.Tensor) -> torch.Tensor:
    """ER clamped to [ER_MIN, ER_MAX] for the weights (module docstring)."""
    return risk.double().clamp(ER_MIN, ER_MAX)


def calibrate(base: torch.Tensor, *, risk: torch.Tensor, r: float) -> torch.Tensor:
    """w = w~ / ||w~|| with w~(l) = base(l) * ER(l)^r (paper Algorithm 1, line 9)."""
    return unit(base.double() * effective_risk(risk).pow(r))


def bias_optimal_weights(a: np.ndarray, b: np.ndarray, *,
                         iters: int = 200) -> tuple[np.ndarray, float]:
    """argmin_w sum_l (w_l^2 a_l - 2 w_l b_l) s.t. ||w|| = 1 (Appendix D.2), and its lambda.

    a_l = ||u_l||^2 >= 0, b_l = u_l . grad_l. Stationarity gives w_l = b_l / (a_l - lambda);
    the global minimum is the root of sum_l w_l^2 = 1 with lambda <= min a (then the
    Lagrangian's Hessian diag(a - lambda) is PSD). With t = min a - lambda the norm is
    decreasing in t and <= 1 at t = ||b||, so bisection on (0, ||b||] finds it. If b vanishes on
    the layers attaining min a and the other layers' weights have norm <= 1 at lambda = min a
    (the "hard case"), the remaining norm goes to the first such layer.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    a_min = float(a.min())
    at_min = a == a_min
    b_norm = float(np.linalg.norm(b))
    if not b_norm > 0:
        w = np.zeros_like(a)
        w[int(np.argmax(at_min))] = 1.0
        return w, a_min
    if not np.any(b[at_min] != 0):
        w = np.where(at_min, 0.0, b / np.where(at_min, 1.0, a - a_min))
        rest = 1.0 - float(np.sum(w * w))
        if rest >= 0:
            w[int(np.argmax(at_min))] = math.sqrt(rest)
            return w, a_min

    def norm_sq(t: float) -> float:
        return float(np.sum((b / (a - a_min + t)) ** 2))

    lo, hi = 0.0, b_norm  # norm_sq(lo+) > 1 >= norm_sq(hi)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if norm_sq(mid) > 1.0:
            lo = mid
        else:
            hi = mid
    lam = a_min - hi
    w = b / (a - lam)
    return w / np.linalg.norm(w), lam


def risk_terms(norms: torch.Tensor, *, clip_norm: float) -> torch.Tensor:
    """u(l) = mean_i ||g_i(l)|| / C_i (float64 [L], on the norms' device); examples with
    G_i = 0 count as 0."""
    c = example_norms(norms).clamp(max=clip_norm)
    ratio = norms / c.unsqueeze(1)
    ratio = torch.where((c.unsqueeze(1) > 0) & torch.isfinite(ratio), ratio, 0.0)
    return ratio.mean(dim=0).double()


def bias_terms(view: PerExampleView, *, num_layers: int, layer_of: Mapping[str, int],
               clip_norm: float) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of Appendix D.2 from a batch: a_l = ||u_l||^2, b_l = u_l . mean_i g_i(l),
    with u_l = mean_i C_i g_i(l) / ||g_i(l)||: two weighted sums of the gradient view, read
    on the host for the bisection (``bias_optimal`` reads once per estimate of u)."""
    norms = view.norms
    c = example_norms(norms).clamp(max=clip_norm)
    coef = c.unsqueeze(1) / norms
    coef = torch.where((norms > 0) & torch.isfinite(coef), coef, 0.0)
    n = norms.shape[0]
    u = view.weighted_sum(coef)
    mean = view.weighted_sum(torch.ones_like(norms))
    a = np.zeros(num_layers)
    b = np.zeros(num_layers)
    for name, u_p in u.items():
        layer = layer_of[name]
        u_p = u_p.double() / n
        a[layer] += float(u_p.pow(2).sum())
        b[layer] += float((u_p * mean[name].double() / n).sum())
    return a, b


# ---- where u comes from: one estimator per source (modes as data) --------------------------
class _UEstimator:
    """Keeps the method's weight vector w current from one source of u(l)."""

    def before_step(self, method: LMDPSGD, step: int) -> None:
        """Public data: refresh before the private batch is touched."""

    def during_clip(self, method: LMDPSGD, view: PerExampleView) -> None:
        """Private data: the paper's Algorithm 1 reads the batch being clipped."""

    def after_release(self, method: LMDPSGD, noisy: dict[str, torch.Tensor]) -> None:
        """Released outputs: post-processing of the noisy gradient."""


class _PublicU(_UEstimator):
    def before_step(self, method: LMDPSGD, step: int) -> None:
        # no host read with the default 'risk' rule: u, and so w, stay on the device
        if method.refresh_due(step, last=method._refreshed_at):
            x, y = method.public_batch(int(method.params["public_batch_size"]))
            method._w = method.weights_from(method.gradients(x, y))
            method._refreshed_at = step


class _PrivateU(_UEstimator):
    def during_clip(self, method: LMDPSGD, view: PerExampleView) -> None:
        method._w = method.weights_from(view)


class _ReleasedU(_UEstimator):
    def after_release(self, method: LMDPSGD, noisy: dict[str, torch.Tensor]) -> None:
        """u(l)^2 = EMA(||g~(l)||^2 - n_l (sigma_l / B)^2) / EMA(w(l)^2), on the device: the
        noise energies n_l (sigma_l / B)^2 are host numbers, copied when they change."""
        batch = method.expected_batch_size
        first = next(iter(noisy.values()))
        sq = torch.zeros(method.num_layers, dtype=torch.float64, device=first.device)
        count = [0] * method.num_layers
        for n, g in noisy.items():
            sq[method.layer_of[n]] += (g.double() / batch).pow(2).sum()
            count[method.layer_of[n]] += g.numel()
        energy = [k * (s / batch) ** 2 for k, s in zip(count, method.noise_std(), strict=True)]
        signal = sq - method.device_constant("noise_energy", energy, device=sq.device)
        beta = float(method.params["lagged_beta"])
        method._lag_num = beta * method._lag_num + (1 - beta) * signal
        method._lag_den = beta * method._lag_den + (1 - beta) * method._w.pow(2)
        ratio = torch.where(method._lag_den > 0, method._lag_num / method._lag_den, 0.0)
        c2 = method.clip_norm ** 2
        u = ratio.clamp(min=U_FLOOR ** 2 * c2, max=c2).sqrt()
        method._w = calibrate(u, risk=method.risk, r=method.r)


_U_FROM: dict[Source, type[_UEstimator]] = {
    Source.PUBLIC: _PublicU, Source.PRIVATE: _PrivateU, Source.RELEASED: _ReleasedU}
#: The statistic the modes differ in.
U_STAT = "layer weights u(l)"
RISK_STAT = "layer risk ER(l)"


def _risk_vector(value: Any) -> list[float]:
    if (not isinstance(value, (list, tuple)) or not value
            or not all(is_real(e) and 0 <= e <= 1 for e in value)):
        raise ValueError
    return [float(e) for e in value]


#: The risk emphasis (searched: search_spaces/lm_dpsgd.py).
R = Param("r", 3.0, "risk emphasis r (Table 2: 2-5; App. E.4 sweeps 1-5)", low=0.0,
          high=20.0, presets={"paper": 5.0})


# ---- the method --------------------------------------------------------------------------
@register
class LMDPSGD(DPStep):
    name: ClassVar[str] = "lm_dpsgd"
    summary: ClassVar[str] = ("layer-wise MIA-risk-aware DP-SGD: per-example layer blocks "
                              "rescaled by u(l) ER(l)^r with ||G_i|| = min(C, ||g_i||)")
    citation: ClassVar[str] = ("Meng, Huang, Hou, Zheng & Chen, Mitigating Membership Inference "
                               "in Intermediate Representations via Layer-wise MIA-risk-aware "
                               "DP-SGD")
    argument: ClassVar[str] = (
        "each example's reweighted gradient has norm C_i = min(C, ||G_i||) <= C whatever the "
        "other examples are, because the unit layer weights w depend on no private example; "
        "noise sigma * C per layer; plain DP-SGD accounting.")
    modes: ClassVar[tuple[Mode, ...]] = (
        Mode("public", {U_STAT: Source.PUBLIC, RISK_STAT: Source.PUBLIC},
             doc="u from per-example gradients of a public batch at the current weights"),
        Mode("lagged", {U_STAT: Source.RELEASED, RISK_STAT: Source.PUBLIC},
             doc="u from the previous released noisy gradient"),
        Mode("faithful", {U_STAT: Source.PRIVATE, RISK_STAT: Source.PUBLIC},
             doc="the paper's Algorithm 1: u from the private batch itself"),
    )
    # Table 2, MNIST row (S-CNN; the closest to our small MNIST-class CNNs): eta = 0.08,
    # C = 1.0, r = 5.0 (plain SGD). The preset keeps C and r; eta is tied to the paper's batch
    # size and schedule and undertrains at ours (0.67 vs 0.80 on Fashion-MNIST in 5 epochs),
    # so lr stays the sweep's. The paper's ER is measured on the attack's training data and
    # its u on the private batch: er_eval = "train" and mode = "faithful" reproduce it
    # exactly, at the cost of an invalid epsilon claim.
    params: ClassVar[ParamSet] = ParamSet.of(
        LR.replace(doc="learning rate (the paper's eta 0.08 is tied to its batch size)"),
        CLIP.replace(presets={"paper": 1.0}),
        MOMENTUM,
        Param("weights", "risk", "weight rule: 'risk' (Sec. 4.3, w~ = u ER^r) or "
              "'bias_optimal' (App. D.2, the clipping-bias optimum, then ER^r)",
              choices=("risk", "bias_optimal"), role="setting"),
        R,
        Param("public_batch_size", 64, "public examples whose per-example norms give u at "
              "each refresh", low=1, modes=("public",), role="setting"),
        public_every("u_every", what="u"),
        Param("lagged_beta", 0.9, "EMA factor of the debiased release statistics", low=0.0,
              high=1.0, high_open=True, modes=("lagged",), role="setting"),
        Param("er_eval", "heldout", "where ER is measured: held-out attack data, or the "
              "attack's own training data ('train', the paper's App. B line 31)",
              choices=("heldout", "train"), role="setting", presets={"paper": "train"}),
        Param("attack", "mlp", "stage-1 attack classifier", choices=("mlp", "logreg"),
              role="setting"),
        Param("stage1_examples", 4000, "shadow-pool examples for stage 1 (half members); 0 = "
              "the whole pool (a capped pool overfits in seconds and still gives each attack "
              "~1,000 examples per class)", low=0, role="setting"),
        Param("stage1_steps", 400, "shadow-model Adam steps", low=1, role="setting"),
        Param("stage1_batch_size", 128, "shadow-model batch size", low=1, role="setting"),
        Param("stage1_lr", 3e-3, "shadow-model Adam learning rate", low=0.0, low_open=True,
              high=10.0, role="setting"),
        Param("risk", None, "ER per layer, filled by stage 1 (or given)", kind="list",
              nullable=True, rule=_risk_vector, role="prepared",
              allowed_text="a list of per-layer error rates in [0, 1]"),
        Param("risk_meta", None, "stage 1's provenance (filled by it)", kind="table",
              nullable=True, role="prepared"),
        constraints=(
            Constraint("weights", lambda p: not (p["mode"] == "lagged"
                                                 and p["weights"] == "bias_optimal"),
                       "'risk' in lagged mode (bias_optimal needs the unclipped layer "
                       "gradients, which a released gradient does not reveal); or mode "
                       "'public' / 'faithful'"),
            Constraint("stage1_examples", lambda p: p["stage1_examples"] == 0
                       or p["stage1_examples"] >= MIN_STAGE1_EXAMPLES,
                       f"0 (the whole shadow pool) or an integer >= {MIN_STAGE1_EXAMPLES}"),
        ),
    )
    fast_lifecycle: ClassVar[dict[str, Any]] = {"u_every": 2}

    # ---- class-level hooks ----------------------------------------------------------------
    @classmethod
    def check_setting(cls, params: Mapping[str, Any], *, num_layers: int,
                      sizes: Mapping[str, int]) -> None:
        if params["risk"] is not None:
            if len(params["risk"]) != num_layers:
                raise UserInputError(field="method_params.risk", value=params["risk"],
                                     allowed=f"one error rate per layer ({num_layers})")
        elif sizes["shadow"] < MIN_STAGE1_EXAMPLES:
            raise UserInputError(field="data.shadow_size", value=sizes["shadow"],
                                 allowed=f">= {MIN_STAGE1_EXAMPLES} public examples for "
                                         "lm_dpsgd's risk estimate (stage 1)")

    @classmethod
    def prepare(cls, *, data: Any, model_factory: Any, params: Mapping[str, Any], seed: int,
                cache_dir: Any) -> dict[str, Any]:
        """Stage 1 (public shadow pool only, cached); a user-given ``risk`` is kept as is."""
        p = cls.validate_params(params)
        if p["risk"] is not None:
            return {}
        # stage 1 needs scikit-learn and torch: ``config --check`` imports this module
        from dpsweep.trainables.audit.layer_risk import estimate_layer_risk

        return estimate_layer_risk(data=data, model_factory=model_factory, seed=seed,
                                   stage1=Stage1.from_params(p), cache_dir=cache_dir)

    # ---- construction ---------------------------------------------------------------------
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        p = self.params
        if p["risk"] is None:
            raise UserInputError(field="method_params.risk", value=None,
                                 allowed="the per-layer risk vector; lm_dpsgd.prepare() "
                                         "computes it once per sweep (plan_trial calls it)")
        self.weights_rule: str = p["weights"]
        self.r = float(p["r"])
        self.risk = torch.tensor(self._trained_risk(list(p["risk"])), dtype=torch.float64,
                                 device=self.device)
        self.u_estimator = _U_FROM[self.mode.sources[U_STAT]]()
        if self.mode.sources[U_STAT] is Source.PUBLIC:
            self.public_refresh_every = self.refresh_period(
                p["u_every"], public_batch=int(p["public_batch_size"]))
        # Uniform u until the first estimate (lagged: until the first release). w and the
        # lagged statistics live on the model's device: the step reads none of them.
        self._w = calibrate(torch.ones(self.num_layers, device=self.device), risk=self.risk,
                            r=self.r)
        self._refreshed_at: int | None = None
        self._lag_num = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)
        self._lag_den = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)

    def _trained_risk(self, risk: list[float]) -> list[float]:
        """The risk of each trained layer. Stage 1 estimates one per layer of the model (its
        audit's layers); a frozen layer is not trained and a parameter that is a layer of its
        own has no output to attack, so it gets the lowest error rate of the model (the
        leakiest layer's: the cautious choice)."""
        full = list(self.model.model.layer_names)
        if len(risk) == len(full) and full != self.model.layer_names:
            by_name = dict(zip(full, risk, strict=True))
            return [by_name.get(n, min(risk)) for n in self.model.layer_names]
        if len(risk) != self.num_layers:
            raise UserInputError(field="method_params.risk", value=risk,
                                 allowed=f"one error rate per layer of the model "
                                         f"({len(full)}: {full})")
        return risk

    @property
    def weight_vector(self) -> list[float]:
        """The current unit weight vector w (one entry per layer)."""
        return self._w.tolist()

    # ---- weights --------------------------------------------------------------------------
    def weights_from(self, view: PerExampleView) -> torch.Tensor:
        """w from a batch's gradient view, by the configured rule."""
        if self.weights_rule == "bias_optimal":
            a, b = bias_terms(view, num_layers=self.num_layers, layer_of=self.layer_of,
                              clip_norm=self.clip_norm)
            base, _ = bias_optimal_weights(a, b)
            return calibrate(torch.from_numpy(base).to(self.device), risk=self.risk, r=self.r)
        return calibrate(risk_terms(view.norms, clip_norm=self.clip_norm), risk=self.risk,
                         r=self.r)

    def begin_step(self, step: int) -> None:
        self.u_estimator.before_step(self, step)

    # ---- clipping -------------------------------------------------------------------------
    def coefficients(self, norms: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """coef_il = C_i * w_l / ||g_il|| (0 for a zero block, or a block so small that the
        coefficient overflows: it then contributes 0, still within the bound)."""
        c = example_norms(norms).clamp(max=self.clip_norm)
        coef = c.unsqueeze(1) * w.to(device=norms.device, dtype=norms.dtype).unsqueeze(0) / norms
        return torch.where((norms > 0) & torch.isfinite(coef), coef, 0.0)

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """[B, L] coefficients with the current w."""
        return self.coefficients(norms, self._w)

    def clip(self, view: PerExampleView) -> dict[str, torch.Tensor]:
        self.u_estimator.during_clip(self, view)
        return super().clip(view)

    def end_step(self, noisy: dict[str, torch.Tensor]) -> None:
        self.u_estimator.after_release(self, noisy)

    # ---- reporting ------------------------------------------------------------------------
    def epoch_metrics(self) -> dict[str, float]:
        w = self._w.tolist()
        return {**super().epoch_metrics(),
                **{f"lm_w_{name}": v for name, v in zip(self.model.layer_names, w, strict=True)}}

    def extra_record(self) -> dict[str, Any]:
        used = [p.name for p in self.declaration() if p.modes and self.mode.name in p.modes]
        return {
            "weights": self.weights_rule,
            "r": self.r,
            "risk": self.risk.tolist(),
            "risk_effective": effective_risk(self.risk).tolist(),
            "risk_meta": self.params["risk_meta"],
            "final_weights": self._w.tolist(),
            **{k: self.params[k] for k in used},
            **({"u_every": self.public_refresh_every} if "u_every" in used else {}),
        }

    # ---- checkpointing --------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"w": self._w.cpu().clone(), "refreshed_at": self._refreshed_at,
                "lag_num": self._lag_num.cpu().clone(), "lag_den": self._lag_den.cpu().clone()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self._w = state["w"].double().to(self.device)
        self._refreshed_at = (None if state["refreshed_at"] is None
                              else int(state["refreshed_at"]))
        self._lag_num = state["lag_num"].double().to(self.device)
        self._lag_den = state["lag_den"].double().to(self.device)
