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

While it reads every reference's representations it also keeps a digest of each layer's raw
output (:meth:`ShadowClassifier.identical_layers`): a layer whose output is bit-identical in the
target and every reference (a frozen backbone shared through one weights file) cannot depend on
the target's membership, so the audit reports it instead of scoring it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from threadpoolctl import threadpool_limits

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.audit.layer_attack import fit_layer_attack, ir_features, reduce_ir
from dpsweep.trainables.audit.prefix import savings_enabled
from dpsweep.trainables.audit.references import ReferencePlan, ReferenceTrainer
from dpsweep.trainables.audit.signals import logit_confidence
from dpsweep.trainables.data.splits import DataSplits

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.data.splits import Split
    from dpsweep.trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

#: Order statistics kept per block of sorted features.
QUANTILES = 64
#: The classifier (``trainables.audit.layer_attack.make_attack`` kinds): logistic regression
#: transferred from shadows to targets more reliably than the MLP on digits.
KIND = "logreg"
#: Rows per class the classifier fits on (pooled over references, drawn at random): an
#: online plan's 4 references give 4,000 per class on a 2,000-member target, and past a few
#: thousand rows a linear fit on a layer's sorted features gains nothing but time (the offline
#: plan's population gives about this many).
MAX_ROWS_PER_CLASS = 2000
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


def layer_features(model: LayeredModel, x: torch.Tensor, y: torch.Tensor, *, classes: int,
                   digests: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Each layer's unit-order-invariant features with the one-hot label (the attacker of a
    membership query knows the label), and the output layer's logit-scaled confidence;
    ``digests`` receives each layer's raw-output digest (``ir_features``)."""
    raw = ir_features(model, x, digests=digests)
    onehot = torch.nn.functional.one_hot(y, classes).to(torch.float32).numpy()
    blocks = _stat_blocks(model, x)
    out = {name: np.concatenate([unit_invariant(f, blocks=blocks[name]), onehot], axis=1)
           for name, f in raw.items()}
    last = model.layer_names[-1]
    with torch.no_grad():
        conf = logit_confidence(torch.from_numpy(raw[last].astype(np.float64)), y).numpy()
    out[last] = np.concatenate([out[last], conf[:, None]], axis=1)
    return out


@dataclass(frozen=True)
class ClassifierScores:
    """P(member) per scored layer for the plan's candidates, and why any requested layer has
    none (its fit or prediction refused its features, e.g. non-finite values)."""

    scores: dict[str, np.ndarray]
    failed: dict[str, str]


class ShadowClassifier:
    """Collects labelled features from each reference as it is trained, then scores a target.

    Wrap the audit's reference trainer with :meth:`wrap`; each reference contributes the
    examples whose membership in it is known and mixed (``ReferencePlan``: the candidates for
    online references, the population for offline ones), and its layers' raw-output digests on
    them.
    """

    def __init__(self, plan: ReferencePlan, *, classes: int, seed: int) -> None:
        self.plan = plan
        self.classes = classes
        self.seed = seed
        self._members: list[dict[str, np.ndarray]] = []
        self._nonmembers: list[dict[str, np.ndarray]] = []
        self._digests: list[dict[str, str]] = []

    def wrap(self, trainer: ReferenceTrainer) -> ReferenceTrainer:
        def train(data: DataSplits, seed: int, index: int) -> tuple[LayeredModel, float]:
            model, seconds = trainer(data, seed, index)
            self._collect(model, index)
            return model, seconds

        return train

    def calibration(self) -> tuple[Split, np.ndarray]:
        """The examples every reference is read on, and [K, n]: reference k trained on
        example n."""
        plan = self.plan
        if plan.in_mask.any():
            return plan.candidates, plan.in_mask
        return plan.population, plan.population_in_mask

    def _collect(self, model: LayeredModel, index: int) -> None:
        split, masks = self.calibration()
        mask = masks[index]
        digests: dict[str, str] = {}
        feats = layer_features(model, split.x, split.y, classes=self.classes, digests=digests)
        self._members.append({k: v[mask] for k, v in feats.items()})
        self._nonmembers.append({k: v[~mask] for k, v in feats.items()})
        self._digests.append(digests)

    def identical_layers(self, target: LayeredModel) -> list[str]:
        """The target's layers whose raw output on the calibration examples is bit-identical
        to every reference's: frozen and shared, so no attack on them can see membership."""
        if not self._digests:
            raise RuntimeError("no reference features collected: wrap the trainer first")
        split, _ = self.calibration()
        own: dict[str, str] = {}
        ir_features(target, split.x, digests=own)
        return [name for name in target.layer_names
                if all(d.get(name) == own[name] for d in self._digests)]

    def scores(self, target: LayeredModel, *,
               layers: list[str] | None = None) -> ClassifierScores:
        """P(member) per layer (all by default) for the plan's candidates under the target
        model; a layer whose features the classifier refuses is named with the reason.

        One BLAS thread for the fits (savings on): a second made them 7-14x slower on a busy
        2-core machine (a few thousand rows of a few dozen features each)."""
        if not self._members:
            raise RuntimeError("no reference features collected: wrap the trainer first")
        names = list(target.layer_names if layers is None else layers)
        members, nonmembers = _pooled(self._members), _pooled(self._nonmembers)
        cand = self.plan.candidates
        feats = layer_features(target, cand.x, cand.y, classes=self.classes)
        out: dict[str, np.ndarray] = {}
        failed: dict[str, str] = {}
        with (threadpool_limits(limits=1, user_api="blas") if savings_enabled()
              else contextlib.nullcontext()):
            for name in names:
                try:
                    attack = fit_layer_attack(members[name], nonmembers[name], seed=self.seed,
                                              index=target.layer_names.index(name), kind=KIND,
                                              max_per_class=MAX_ROWS_PER_CLASS)
                    out[name] = attack.predict_proba(feats[name])[:, 1]
                except ValueError as exc:  # scikit-learn refuses NaN / infinite features
                    failed[name] = f"the shadow classifier refused the layer's features: {exc}"
        return ClassifierScores(scores=out, failed=failed)


def _pooled(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
