"""Per-example scalar membership signals of one model, per layer, comparable across models.

A calibrated membership attack (LiRA: Carlini et al. 2022, "Membership Inference Attacks From
First Principles", arXiv 2112.03570; RMIA: Zarifzadeh et al. 2024, "Low-Cost High-Power
Membership Inference Attacks", arXiv 2312.03262) compares, for one candidate example, the
target model's value of a scalar signal with the values of reference models that did and did not
train on it. The signal must therefore mean the same thing in independently trained networks,
whose hidden units are not aligned (any permutation of a layer's units is the same function).
Each signal here is a scalar per (model, example) that is invariant to such permutations:

* ``grad_norm:<layer>`` — the natural log of the L2 norm of the example's cross-entropy gradient
  w.r.t. the layer's parameters. Permuting a layer's units permutes its parameters' rows and the
  next layer's columns, which leaves every block norm unchanged. It is the quantity DP-SGD clips
  per example, and a trained-on example sits near a minimum of its own loss, so its gradient is
  small in every layer. The log: norms are positive and vary multiplicatively across models
  (a member's norm is 10-1000x below a non-member's), so per example across reference models the
  log is much closer to Gaussian than the raw norm, which LiRA's Gaussian fit needs. Measured by
  ``bench/audit_fmnist.py`` (Fashion-MNIST cnn28, median |skewness| of a candidate's values over
  16 offline references): 0.43-0.55 for the log vs 1.60-1.73 raw per layer, and offline LiRA's
  AUC 0.718-0.723 (log) vs 0.683-0.695 (raw). Every layer's gradient is a linear image of the
  same output residual p - e_y, so the per-layer signals are strongly correlated (0.97-0.998
  across layers on that target) and their leakage is nearly flat in depth; what they add over
  the output is that they are the quantities per-layer clipping bounds. Computed exactly (not
  estimated) by ``trainables.engine.grad_engine.GradEngine`` — book-keeping per-example norms,
  several times cheaper than ``torch.func.vmap(grad)``, which the tests use as the reference —
  in float32 on a rescaled residual (:func:`scaled_residual`), to float64's range.
* ``logit`` — LiRA's logit-scaled confidence of the true class, log(p_y / (1 - p_y)) =
  z_y - logsumexp_{j != y} z_j, computed from the logits so it never saturates (probabilities
  round to 1 for confident examples). The output units are the classes in every model.
* ``loss`` — the cross-entropy, for the loss-threshold baseline (Yeom et al. 2018).
* ``probe_loss:<layer>`` — a linear probe's cross-entropy on the layer's representation
  (``trainables.audit.probes``), the per-layer signal whose leakage grows with depth.

Members have *higher* logits and *lower* gradient norms and losses; :func:`member_direction`
says which, so attacks can orient every score as "larger = member". RMIA needs a
probability-like Pr(x | theta) in [0, 1]; :func:`membership_probability` maps each signal to one
that is exactly the true-class probability for ``logit`` (sigmoid) and ``loss`` (exp(-loss)) and
is 1 / (1 + ||g||) for gradient norms (sigmoid of the oriented log norm: 1 at a zero gradient).
RMIA therefore runs once on the output (:func:`rmia_input`): its score of ``logit`` and of
``loss`` would be the same attack.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
from scipy.special import expit

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.core.poisson import PHYSICAL_BATCH
from dpsweep.trainables.audit.prefix import savings_enabled
from dpsweep.trainables.engine.grad_engine import GradEngine

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.audit.prefix import SharedPrefix
    from dpsweep.trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

#: Signal names: ``GRAD_NORM + ":" + layer`` per layer, and the two output signals.
GRAD_NORM = "grad_norm"
LOGIT = "logit"
LOSS = "loss"
#: A layer's linear-probe loss (``trainables.audit.probes``): per layer like GRAD_NORM.
PROBE_LOSS = "probe_loss"
PER_LAYER_KINDS = (GRAD_NORM, PROBE_LOSS)
SIGNAL_KINDS = (GRAD_NORM, PROBE_LOSS, LOGIT, LOSS)
#: Smallest gradient norm whose log is taken: an exactly zero norm (a float64 softmax that
#: rounds to one-hot, logit margins above ~37) would give -inf and break the Gaussian fits.
MIN_GRAD_NORM = 1e-300
LOG_MIN_GRAD_NORM = math.log(MIN_GRAD_NORM)
#: A residual row divided by 2^e adds e ln 2 to its log norms.
LN2 = math.log(2.0)
#: The float32 path's agreement with the float64 one (``exact=True``) on log gradient norms,
#: absolute. Rounding of the rescaled residual costs ~1e-6; the engine's float32 norms are
#: certified upper bounds (``trainables.engine.norms``), above the true norm by up to ~7e-4 in
#: log where a layer's rank-one terms cancel (cnn28's conv2); a candidate's log norm spreads by
#: 0.3 or more across references.
FLOAT32_LOG_NORM_TOLERANCE = 2e-3

Signals = dict[str, np.ndarray]


@runtime_checkable
class SharingSignals(Protocol):
    """Further signals (``collect_signals``' ``extra``) that can read a shared prefix
    (``trainables.audit.probes.ProbeSignals``): what they keep of each prefix layer's output
    while the table is made, and their signals of a model whose prefix the table feeds."""

    def features(self, ir: torch.Tensor) -> torch.Tensor:
        ...

    def shared(self, model: LayeredModel, x: torch.Tensor, y: torch.Tensor, *,
               prefix: SharedPrefix) -> Signals:
        ...



def grad_norm_name(layer: str) -> str:
    """The signal name of a layer's gradient norm."""
    return f"{GRAD_NORM}:{layer}"


def signal_kind(name: str) -> str:
    """``grad_norm``, ``probe_loss``, ``logit`` or ``loss`` for a signal name."""
    kind = name.split(":", 1)[0]
    if kind not in SIGNAL_KINDS or (kind in PER_LAYER_KINDS) != (":" in name):
        raise UserInputError(field="signal", value=name,
                             allowed=f"'{LOGIT}', '{LOSS}', '{GRAD_NORM}:<layer>' or "
                                     f"'{PROBE_LOSS}:<layer>'")
    return kind


def member_direction(name: str) -> int:
    """+1 when members have larger values of the signal, -1 when smaller."""
    return 1 if signal_kind(name) == LOGIT else -1


def membership_probability(*, name: str, values: np.ndarray) -> np.ndarray:
    """RMIA's Pr(x | theta) for a signal's values (module docstring): larger for members."""
    v = np.asarray(values, dtype=np.float64)
    kind = signal_kind(name)
    if kind in (LOSS, PROBE_LOSS):  # the (probe's) true-class probability
        return np.exp(-v)
    return expit(member_direction(name) * v)


def rmia_input(name: str) -> str:
    """The signal whose :func:`membership_probability` RMIA reads for ``name``: ``logit`` for
    both output signals, since sigmoid(logit) and exp(-loss) are the same true-class
    probability and RMIA's ratio depends on nothing else (an RMIA on ``loss`` would repeat the
    one on ``logit`` and only inflate the multiple-testing correction); the name itself
    otherwise."""
    return LOGIT if signal_kind(name) in (LOGIT, LOSS) else name


def logit_confidence(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log(p_y / (1 - p_y)) = z_y - logsumexp_{j != y} z_j, exact where p_y rounds to 1."""
    true = logits.gather(1, y[:, None])[:, 0]
    others = logits.scatter(1, y[:, None], float("-inf")).logsumexp(dim=1)
    return true - others


def scaled_residual(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's output residual p - e_y divided by 2^e (its largest magnitude then in
    [1/2, 1], up to rounding), float64, and e per row.

    Formed in log space from the logits (log p_j = z_j - lse; log(1 - p_y) = lse_{j != y} - lse),
    so the true class's component survives where p_y rounds to 1 (in float64 beyond a margin of
    ~37) and no component underflows: backpropagated in float32, the rescaled row keeps every
    layer's gradient norm to float32's relative precision, whatever its size."""
    z = logits.detach().to(torch.float64)
    rows = y[:, None]
    lse = z.logsumexp(dim=1, keepdim=True)
    others = z.scatter(1, rows, float("-inf")).logsumexp(dim=1, keepdim=True)
    log_abs = (z - lse).scatter(1, rows, others - lse)
    top = log_abs.max(dim=1, keepdim=True).values
    # a row with no finite component (one class; NaN logits) keeps e = 0 and its NaN or zeros
    e = torch.where(torch.isfinite(top), torch.floor(top / LN2) + 1, torch.zeros_like(top))
    scaled = (log_abs - e * LN2).exp()
    scaled = scaled.scatter(1, rows, -scaled.gather(1, rows))
    return scaled, e[:, 0]


def per_example_signals(*, model: LayeredModel, x: torch.Tensor, y: torch.Tensor,
                        batch: int = PHYSICAL_BATCH, grad_norms: bool = True,
                        shared: SharedPrefix | None = None, exact: bool = False) -> Signals:
    """{signal name: float64 [N]} for ``model`` on examples (x, y): every layer's log gradient
    norm (unless ``grad_norms`` is False), ``logit`` and ``loss``.

    An overfit model's members have gradient norms many orders below its non-members', and a
    float32 backward of the cross-entropy loses the true class's component of the gradient once
    p_y rounds to 1. So a float32 copy of the model in eval mode (the caller's is untouched)
    backpropagates each example's exactly formed residual rescaled by a power of two
    (:func:`scaled_residual`), and the scale returns in float64 to the log norm: float64's
    range at float32's cost, within ``FLOAT32_LOG_NORM_TOLERANCE`` of the float64 path. That
    path (a float64 copy backpropagating the cross-entropy) runs with ``exact``, without the
    audit's savings (``trainables.audit.prefix``), and on the whole-model ``torch.func`` path,
    which takes no rescaled residual. The output signals come from the logits in float64. With
    ``shared`` (a frozen prefix covering ``model``, ``trainables.audit.prefix``) the copy runs
    only its suffix, on the prefix's stored float32 outputs. Token ids stay integers.
    """

    if batch < 1:
        raise UserInputError(field="batch", value=batch, allowed="an integer >= 1")
    work = copy.deepcopy(model).to(dtype=torch.float32).eval()
    engine = GradEngine(work, max_physical_batch=batch) if grad_norms else None
    if exact or not savings_enabled() or (engine is not None and engine.strategy == "vmap"):
        work = work.to(dtype=torch.float64)
        engine = GradEngine(work, max_physical_batch=batch) if grad_norms else None
        exact = True
    device = next(work.parameters()).device
    xs = x.to(device=device, dtype=_float_dtype(work) if x.is_floating_point() else x.dtype)
    ys = y.to(device=xs.device, dtype=torch.long)
    out: dict[str, list[np.ndarray]] = {LOGIT: [], LOSS: []}
    if engine is not None:
        # trained layers with an output: a frozen layer has no gradient to measure (its
        # output is still attacked by the IR classifier), a parameter alone has no output row
        out.update({grad_norm_name(n): [] for n in engine.layer_names if n in work.layer_names})
    with shared.feeding(work) if shared is not None else contextlib.nullcontext():
        _batches(work, xs, ys, batch=batch, engine=engine, out=out, rescale=not exact)
    return {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in out.items()}


def _float_dtype(model: LayeredModel) -> torch.dtype:
    return next(model.parameters()).dtype


def _log_norms(engine: GradEngine, xb: torch.Tensor, yb: torch.Tensor, *,
               rescale: bool) -> np.ndarray:
    """[B, L] log gradient norms of one batch (``rescale``: from :func:`scaled_residual`),
    at least ``LOG_MIN_GRAD_NORM``; NaN stays NaN."""
    live = [True] * engine.num_layers
    if not rescale:
        norms = engine.compute(xb, yb, live=live).norms
        return np.log(np.maximum(norms.detach().cpu().numpy(), MIN_GRAD_NORM))
    exponents: list[torch.Tensor] = []

    def seed(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scaled, e = scaled_residual(logits, y)
        exponents.append(e)
        return scaled

    norms = engine.compute(xb, yb, live=live, seed=seed).norms.detach().cpu().numpy()
    e = exponents[-1].cpu().numpy() if exponents else np.zeros(len(norms))
    with np.errstate(divide="ignore"):  # a zero norm: its log is -inf, then the floor
        logs = np.log(norms) + e[:, None] * LN2
    return np.maximum(logs, LOG_MIN_GRAD_NORM)


def _batches(work: LayeredModel, xs: torch.Tensor, ys: torch.Tensor, *, batch: int,
             engine: GradEngine | None, out: dict[str, list[np.ndarray]],
             rescale: bool) -> None:
    """Append every batch's output signals (and, with ``engine``, its layers' log gradient
    norms) to ``out``. The logits are those of the engine's own forward (savings on, except
    under ``torch.func``, whose forward is per example): a separate forward would repeat the
    engine's."""
    seen: list[torch.Tensor] = []
    merged = engine is not None and engine.strategy != "vmap" and savings_enabled()
    handle = (work.register_forward_hook(lambda module, args, output: seen.append(output))
              if merged else None)
    try:
        for start in range(0, xs.shape[0], batch):
            xb, yb = xs[start:start + batch], ys[start:start + batch]
            seen.clear()
            if engine is not None:
                logs = _log_norms(engine, xb, yb, rescale=rescale)
                for i, n in enumerate(engine.layer_names):
                    if grad_norm_name(n) in out:
                        out[grad_norm_name(n)].append(logs[:, i])
            logits = next((o for o in reversed(seen) if isinstance(o, torch.Tensor)
                           and o.shape[:1] == xb.shape[:1]), None)
            with torch.no_grad():
                logits = (work(xb) if logits is None else logits.detach()).to(torch.float64)
                out[LOGIT].append(logit_confidence(logits, yb).cpu().numpy())
                out[LOSS].append(torch.nn.functional.cross_entropy(logits, yb, reduction="none")
                                 .cpu().numpy())
    finally:
        if handle is not None:
            handle.remove()
