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

import warnings
from typing import TYPE_CHECKING

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from core.errors import UserInputError
from core.lazy import lazy_module
from trainables.audit.layer_attack import reduce_ir
from trainables.audit.references import subset
from trainables.audit.signals import PROBE_LOSS

if TYPE_CHECKING:
    import torch

    from trainables.audit.references import ExtraSignals
    from trainables.data.splits import Split
    from trainables.models.networks import LayeredModel
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


def probe_signals(*, probe_set: Split, num_classes: int) -> ExtraSignals:
    """An ``extra`` signal function for ``collect_signals``: {probe_loss:<layer>: [N]}."""
    counts = np.bincount(probe_set.y.numpy(), minlength=num_classes)
    if counts.min() < MIN_PER_CLASS:
        raise UserInputError(field="audit.layer_probes", value=f"probe set of {len(probe_set)}",
                             allowed=f"at least {MIN_PER_CLASS} probe examples per class (a "
                                     f"larger validation split), or layer_probes = false")

    def extra(model: LayeredModel, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                device = next(model.parameters()).device
                _, fit_irs = model.forward_with_irs(probe_set.x.to(device))
                _, irs = model.forward_with_irs(x.to(device))
        finally:
            model.train(was_training)
        rows = np.arange(len(y))
        labels = y.cpu().numpy()
        out: dict[str, np.ndarray] = {}
        for name in model.layer_names:
            fit = reduce_ir(fit_irs[name].float().cpu()).numpy()
            scaler = StandardScaler().fit(fit)
            probe = LogisticRegression(C=PROBE_C, max_iter=PROBE_MAX_ITER)
            with warnings.catch_warnings():
                # The same capped fit for every model keeps the signal comparable; where lbfgs
                # stops at the cap the probe is a little under-fitted, not wrong.
                warnings.simplefilter("ignore", ConvergenceWarning)
                probe.fit(scaler.transform(fit), probe_set.y.numpy())
            proba = probe.predict_proba(scaler.transform(reduce_ir(irs[name].float().cpu())
                                                         .numpy()))
            full = np.full((len(labels), num_classes), MIN_PROBABILITY)
            full[:, probe.classes_] = np.maximum(proba, MIN_PROBABILITY)
            out[probe_loss_name(name)] = -np.log(full[rows, labels]).astype(np.float64)
        return out

    return extra


def probe_set_of(validation: Split, *, seed: int) -> Split:
    """Up to ``MAX_PROBE_EXAMPLES`` validation examples: private, but never a member of the
    target or of any reference (references train on the shadow pool, or on the train and
    holdout splits); the validation split already drives model selection."""
    n = min(len(validation), MAX_PROBE_EXAMPLES)
    rows = np.sort(np.random.default_rng(seed).permutation(len(validation))[:n])
    return subset(validation, rows)
