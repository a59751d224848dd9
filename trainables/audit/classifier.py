"""The shadow-classifier attack, kept beside the calibrated attacks as one of the reported ones.

Per layer, a logistic regression is fitted on the reference models' representations of examples
whose membership in each reference is known (label 1 = the reference trained on it), pooled over
references, and applied to the target's representations of the audited candidates: the classic
shadow-model attack (Shokri et al. 2017, "Membership Inference Attacks Against Machine Learning
Models", arXiv 1610.05820) on intermediate representations.

Hidden units of independently trained networks are not aligned (any permutation of a layer's
units is the same network), so a classifier on raw representations fitted on one network meets
a reshuffled feature vector on another and scores at chance (measured on digits: 0.45-0.55 on
every layer, even for an overfit model). The features are therefore each example's sorted
activations (:func:`unit_invariant`: invariant to unit order), thinned to order statistics,
plus its one-hot label; the output layer also gets the true class's logit-scaled confidence.
The calibrated attacks (``scores.py``) are stronger; this one is reported so the two families
can be compared on the same references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from core.lazy import lazy_module
from trainables.audit.layer_attack import fit_layer_attacks, ir_features, reduce_ir
from trainables.audit.references import ReferencePlan, ReferenceTrainer
from trainables.audit.signals import logit_confidence
from trainables.data.splits import DataSplits

if TYPE_CHECKING:
    import torch

    from trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

#: Order statistics kept per block of sorted features.
QUANTILES = 64
#: The classifier (``trainables.audit.layer_attack.make_attack`` kinds): logistic regression
#: transferred from shadows to targets more reliably than the MLP on digits.
KIND = "logreg"
#: Name of the attack in audit records.
NAME = "shadow_classifier"
#: The classifier's natural decision: P(member) >= 1/2.
THRESHOLD = 0.5


def unit_invariant(features: np.ndarray, *, blocks: int = 1,
                   quantiles: int = QUANTILES) -> np.ndarray:
    """Each row's values sorted within ``blocks`` equal-width blocks, thinned to at most
    ``quantiles`` evenly spaced order statistics per block (the empirical quantile function of
    the layer's response: how strongly and how sparsely it responds, not which unit does)."""
    if features.shape[1] % blocks:
        raise ValueError(f"{features.shape[1]} features do not split into {blocks} blocks")
    width = features.shape[1] // blocks
    keep = (np.unique(np.linspace(0, width - 1, quantiles).round().astype(np.int64))
            if width > quantiles else np.arange(width))
    return np.concatenate([np.sort(features[:, b * width:(b + 1) * width], axis=1)[:, keep]
                           for b in range(blocks)], axis=1)


def _stat_blocks(model: LayeredModel, x: torch.Tensor) -> dict[str, int]:
    """Per layer, 3 when ``reduce_ir`` turns its map into channel statistics (mean, std, max),
    1 when it keeps every value."""
    with torch.no_grad():
        was_training = model.training
        model.eval()
        _, irs = model.forward_with_irs(x[:1])
        model.train(was_training)
    return {name: 1 if reduce_ir(ir).shape[1] == ir[0].numel() else 3
            for name, ir in irs.items()}


def layer_features(model: LayeredModel, x: torch.Tensor, y: torch.Tensor, *,
                   classes: int) -> dict[str, np.ndarray]:
    """Each layer's unit-order-invariant features with the one-hot label (the attacker of a
    membership query knows the label), and the output layer's logit-scaled confidence."""
    raw = ir_features(model, x)
    onehot = torch.nn.functional.one_hot(y, classes).to(torch.float32).numpy()
    blocks = _stat_blocks(model, x)
    out = {name: np.concatenate([unit_invariant(f, blocks=blocks[name]), onehot], axis=1)
           for name, f in raw.items()}
    last = model.layer_names[-1]
    with torch.no_grad():
        conf = logit_confidence(torch.as_tensor(raw[last], dtype=torch.float64), y).numpy()
    out[last] = np.concatenate([out[last], conf[:, None]], axis=1)
    return out


class ShadowClassifier:
    """Collects labelled features from each reference as it is trained, then scores a target.

    Wrap the audit's reference trainer with :meth:`wrap`; each reference contributes the
    examples whose membership in it is known and mixed (``ReferencePlan``: the candidates for
    online references, the population for offline ones).
    """

    def __init__(self, plan: ReferencePlan, *, classes: int, seed: int) -> None:
        self.plan = plan
        self.classes = classes
        self.seed = seed
        self._members: list[dict[str, np.ndarray]] = []
        self._nonmembers: list[dict[str, np.ndarray]] = []

    def wrap(self, trainer: ReferenceTrainer) -> ReferenceTrainer:
        def train(data: DataSplits, seed: int, index: int) -> tuple[LayeredModel, float]:
            model, seconds = trainer(data, seed, index)
            self._collect(model, index)
            return model, seconds

        return train

    def _collect(self, model: LayeredModel, index: int) -> None:
        plan = self.plan
        if plan.in_mask.any():
            split, mask = plan.candidates, plan.in_mask[index]
        else:
            split, mask = plan.population, plan.population_in_mask[index]
        feats = layer_features(model, split.x, split.y, classes=self.classes)
        self._members.append({k: v[mask] for k, v in feats.items()})
        self._nonmembers.append({k: v[~mask] for k, v in feats.items()})

    def scores(self, target: LayeredModel) -> dict[str, np.ndarray]:
        """P(member) per layer for the plan's candidates under the target model."""
        if not self._members:
            raise RuntimeError("no reference features collected: wrap the trainer first")
        attacks = fit_layer_attacks(_pooled(self._members), _pooled(self._nonmembers),
                                    seed=self.seed, kind=KIND)
        cand = self.plan.candidates
        feats = layer_features(target, cand.x, cand.y, classes=self.classes)
        return {name: attack.predict_proba(feats[name])[:, 1] for name, attack in attacks.items()}


def _pooled(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
