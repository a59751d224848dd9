"""Per-layer representation signals: the loss of a linear probe fitted on unseen examples.

Every layer's gradient norm is a linear image of one output residual p - e_y, so the
gradient-norm signals (``trainables.audit.signals``) are strongly correlated across layers and
their leakage is nearly flat in depth. What a layer's *representation* reveals is a different
question: how well a member's class can be read off that layer, compared with examples the model
never saw. For each model (target and every reference) and each layer, a multinomial logistic
probe is fitted on the layer's features of a fixed probe set that no model trained on; the
signal is the probe's cross-entropy on each candidate (lower = member). The probe is
L2-regularised and fitted on standardised features, so it is equivariant to permuting the
layer's units and the signal is a per-example scalar comparable across independently trained
networks. Measured on an overfit Fashion-MNIST cnn28 (``bench/audit_fmnist.py``, 1000 members,
online references): the probe signal's best AUC grows with depth (0.51, 0.57, 0.69, 0.73 from
conv1 to fc2), while the gradient norms' stays at 0.75-0.77 in every layer.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.audit.layer_attack import ir_features, reduce_ir
from dpsweep.trainables.audit.prefix import prefix_outputs, savings_enabled
from dpsweep.trainables.audit.references import subset
from dpsweep.trainables.audit.signals import PROBE_LOSS

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.audit.prefix import SharedPrefix
    from dpsweep.trainables.data.splits import Split
    from dpsweep.trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

#: Largest probe set (examples): the fit's cost grows with it, its variance falls.
MAX_PROBE_EXAMPLES = 1000
#: Fewest probe examples per class for a fit that is not mostly regularisation.
MIN_PER_CLASS = 5
#: Inverse L2 strength of the probe (scikit-learn's C) and its iteration cap.
PROBE_C = 1.0
PROBE_MAX_ITER = 300
#: Smallest probability whose log is taken (a probe certain of a wrong class).
MIN_PROBABILITY = 1e-300


def probe_loss_name(layer: str) -> str:
    """The signal name of a layer's probe loss."""
    return f"{PROBE_LOSS}:{layer}"


def probe_signals(*, probe_set: Split, num_classes: int) -> ProbeSignals:
    """An ``extra`` signal function for ``collect_signals``: {probe_loss:<layer>: [N]}."""
    counts = np.bincount(probe_set.y.numpy(), minlength=num_classes)
    if counts.min() < MIN_PER_CLASS:
        raise UserInputError(field="audit.layer_probes", value=f"probe set of {len(probe_set)}",
                             allowed=f"at least {MIN_PER_CLASS} probe examples per class (a "
                                     f"larger validation split), or layer_probes = false")
    return ProbeSignals(probe_set=probe_set, num_classes=num_classes)


@dataclass(frozen=True, eq=False)
class _PrefixProbes:
    """For one shared prefix and input: the prefix layers' probe losses (the same in every
    model the prefix covers) and the prefix with the probe set's stored outputs added."""

    source: SharedPrefix
    x: torch.Tensor
    losses: dict[str, np.ndarray]
    shared: SharedPrefix | None


class ProbeSignals:
    """Every layer's probe loss for one model (:meth:`__call__`); with a shared frozen prefix
    (:meth:`shared`) the prefix layers' probes are fitted once, since their features are the
    same in every model the prefix covers, and each model runs its suffix only."""

    def __init__(self, *, probe_set: Split, num_classes: int) -> None:
        self.probe_set = probe_set
        self.num_classes = num_classes
        self._memo: _PrefixProbes | None = None

    @staticmethod
    def features(ir: torch.Tensor) -> torch.Tensor:
        """A layer's output as the probe reads it (``reduce_ir``, float32, on the CPU)."""
        return reduce_ir(ir.float().cpu())

    def __call__(self, model: LayeredModel, x: torch.Tensor,
                 y: torch.Tensor) -> dict[str, np.ndarray]:
        fit_irs, irs = self._irs(model, x, layers=None)
        return self._fit(model.layer_names, fit_irs, irs, y)

    def shared(self, model: LayeredModel, x: torch.Tensor, y: torch.Tensor, *,
               prefix: SharedPrefix) -> dict[str, np.ndarray]:
        """As :meth:`__call__`, ``model``'s prefix read from ``prefix`` (which covers it)."""
        memo = self._prefix_probes(model, x, y, prefix)
        if memo is None or memo.shared is None:  # the probe set's outputs would not fit
            return self(model, x, y)
        suffix = [name for name in model.layer_names if name not in prefix.prefix.layers]
        with memo.shared.feeding(model):  # the prefix layers' outputs are placeholders here
            fit_irs, irs = self._irs(model, x, layers=suffix, keep=False)
        return {**memo.losses, **self._fit(suffix, fit_irs, irs, y)}

    def _prefix_probes(self, model: LayeredModel, x: torch.Tensor, y: torch.Tensor,
                       prefix: SharedPrefix) -> _PrefixProbes | None:
        """The prefix layers' probes, fitted on the first call for ``prefix`` and ``x`` (None
        when ``prefix`` kept no features of ``x``)."""
        memo = self._memo
        if memo is not None and memo.source is prefix and memo.x is x:
            return memo
        if prefix.features is None:
            return None
        fit: dict[str, list[torch.Tensor]] = {name: [] for name in prefix.prefix.layers}
        outputs = prefix_outputs(model, prefix.prefix, self.probe_set.x,
                                 keep=lambda name, out: fit[name].append(self.features(out)))
        losses = self._fit(list(fit), {name: torch.cat(parts) for name, parts in fit.items()},
                           dict(prefix.features), y)
        self._memo = _PrefixProbes(source=prefix, x=x, losses=losses,
                                   shared=prefix.with_outputs(self.probe_set.x, outputs))
        return self._memo

    def _irs(self, model: LayeredModel, x: torch.Tensor, *, layers: list[str] | None,
             keep: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The requested layers' :meth:`features` (all by default) on the probe set and on
        ``x``; those on ``x`` through ``ir_features`` (savings on and ``keep``: not while a
        shared prefix feeds the model), whose forward the shadow classifier's features of the
        same model and candidates share."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                device = next(model.parameters()).device
                _, fit_irs = model.forward_with_irs(self.probe_set.x.to(device), layers)
                if keep and savings_enabled():
                    irs = {name: torch.from_numpy(f.copy()) for name, f in
                           ir_features(model, x.to(device), layers=layers).items()}
                else:
                    irs = {name: self.features(ir) for name, ir in
                           model.forward_with_irs(x.to(device), layers)[1].items()}
        finally:
            model.train(was_training)
        return {name: self.features(ir) for name, ir in fit_irs.items()}, irs

    def _fit(self, layers: list[str], fit_irs: Mapping[str, torch.Tensor],
             irs: Mapping[str, torch.Tensor], y: torch.Tensor) -> dict[str, np.ndarray]:
        """Each layer's probe fitted on the probe set's :meth:`features`, and its loss on every
        row of ``y`` (``irs``: the rows' :meth:`features`).

        One BLAS thread for the fits (savings on): a few hundred small matrix products per fit,
        which a second thread only slows on a shared machine (4-8x on 2 busy cores)."""
        rows = np.arange(len(y))
        labels = y.cpu().numpy()
        out: dict[str, np.ndarray] = {}
        with (threadpool_limits(limits=1, user_api="blas") if savings_enabled()
              else contextlib.nullcontext()):
            for name in layers:
                fit = fit_irs[name].numpy()
                scaler = StandardScaler().fit(fit)
                probe = LogisticRegression(C=PROBE_C, max_iter=PROBE_MAX_ITER)
                with warnings.catch_warnings():
                    # The same capped fit for every model keeps the signal comparable; where
                    # lbfgs stops at the cap the probe is a little under-fitted, not wrong.
                    warnings.simplefilter("ignore", ConvergenceWarning)
                    probe.fit(scaler.transform(fit), self.probe_set.y.numpy())
                proba = probe.predict_proba(scaler.transform(irs[name].numpy()))
                full = np.full((len(labels), self.num_classes), MIN_PROBABILITY)
                # float64 first: MIN_PROBABILITY is 0 in the float32 of float32 features
                full[:, probe.classes_] = np.maximum(proba.astype(np.float64), MIN_PROBABILITY)
                out[probe_loss_name(name)] = -np.log(full[rows, labels]).astype(np.float64)
        return out


def probe_set_of(validation: Split, *, seed: int) -> Split:
    """Up to ``MAX_PROBE_EXAMPLES`` validation examples: private, but never a member of the
    target or of any reference (references train on the shadow pool, or on the train and
    holdout splits); the validation split already drives model selection."""
    n = min(len(validation), MAX_PROBE_EXAMPLES)
    rows = np.sort(np.random.default_rng(seed).permutation(len(validation))[:n])
    return subset(validation, rows)
