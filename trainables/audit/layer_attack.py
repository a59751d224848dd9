"""Per-layer membership-inference attack building blocks (LM-DP-SGD's risk estimate, the audit).

An attack on layer l sees only that layer's output (its intermediate representation, IR) for an
example and guesses whether the example was a training member (label 1) or not (label 0). One
classifier per layer, fitted by scikit-learn on the IRs of a shadow model's members and
non-members; its error rate on labelled IRs is the layer's risk estimate (lower = leakier).

Features (:func:`reduce_ir`):

* Conv maps ``[C, H, W]`` with at most ``max_flat`` values (1,024: every map of ``digits_cnn``,
  ``cnn28``'s second conv) are flattened. Larger maps (``cnn28``'s first conv has 2,704 values,
  ``cnn5``'s 6,272) become per-channel statistics over the spatial positions, mean, standard
  deviation and maximum (``3 C`` features): flattened they would give the attack more dimensions
  than it has examples, so it would memorise its own training IRs and take seconds per fit,
  while the channel statistics keep how strongly and how peakedly each filter responds, and
  drop where in the image it does, which is not what differs between members and non-members.
* Optionally (``sort_units``) the values are then sorted in decreasing order (each statistic
  separately across channels). Two models trained from different initialisations compute the
  same function with their hidden units (channels) permuted, so unit k of a shadow model means
  nothing for unit k of another model; the sorted profile is invariant to that permutation. It
  also makes the logit layer class-agnostic: sorted logits are the sorted-posterior attack of
  Salem et al. (ML-Leaks, 2019), which reads confidence, the main membership signal, whatever
  the class. On a Fashion-MNIST shadow ``cnn28`` sorting lifted the held-out accuracy of the
  logit layer's attack from ~0.50 to ~0.60 (fc1: ~0.52 to ~0.55; the convs stay at chance).
  Off by default: the raw IR is what "the layer's output" means, and callers that sort
  themselves (the audit) get it unchanged.

Attacks are trained on balanced classes (the larger class is subsampled with a seeded
generator) so that 0.5 accuracy is chance whatever the pool sizes, and they are scored with
balanced accuracy for the same reason. The default classifier is a one-hidden-layer MLP with
early stopping on a validation tenth: nonlinear (confidence is not linear in the IR) and,
unlike a fully trained MLP, it does not memorise a few hundred examples.

:func:`ir_features` keeps the features and digests of its last few (model, input) pairs (the
default reduction, all layers): the audit reads one model's layers on the candidates for its
probes and its shadow classifier, and the target's twice more, and one forward serves them all.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.base import ClassifierMixin
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.audit.prefix import savings_enabled
from dpsweep.trainables.models.networks import LayeredModel

#: Largest conv map (C * H * W values) kept whole; larger maps become per-channel statistics.
MAX_FLAT = 1024
#: Attack classifiers: "mlp" (one hidden layer, nonlinear, the usual IR attack) or "logreg".
ATTACK_KINDS = ("mlp", "logreg")

#: Fewest attack examples for the MLP's early-stopping split (a tenth, stratified).
MIN_EARLY_STOP = 40

Features = dict[str, np.ndarray]


def reduce_ir(ir: torch.Tensor, *, max_flat: int = MAX_FLAT,
              sort_units: bool = False) -> torch.Tensor:
    """One layer's output ``[N, ...]`` as attack features ``[N, F]`` (module docstring).

    Dense outputs ``[N, D]`` and conv maps of at most ``max_flat`` values are flattened; larger
    maps ``[N, C, H, W]`` give per-channel ``[mean, std, max]`` over H*W (all C means, then all
    stds, then all maxima). With ``sort_units`` each of those blocks is sorted in decreasing
    order along the features.
    """
    if ir.dim() <= 2 or math.prod(ir.shape[1:]) <= max_flat:
        blocks = [ir.reshape(ir.shape[0], -1)]
    else:
        spatial = ir.flatten(2)  # [N, C, H*W]
        blocks = [spatial.mean(dim=2), spatial.std(dim=2, unbiased=False), spatial.amax(dim=2)]
    if sort_units:
        blocks = [b.sort(dim=1, descending=True).values for b in blocks]
    return torch.cat(blocks, dim=1)


def _digest_update(digest: Any, ir: torch.Tensor) -> None:
    """Feed one chunk of a layer's raw output (shape, dtype and bytes) to its digest."""
    flat = ir.detach().to("cpu").contiguous().reshape(-1)
    digest.update(f"{tuple(ir.shape)}{ir.dtype}".encode())
    digest.update(flat.view(torch.uint8).numpy())  # the buffer itself, no copy


#: (model, input) pairs whose default features :func:`ir_features` keeps: the target and the
#: reference in hand, with room to spare (a few MB each at the audit's sizes).
MEMO_ENTRIES = 3
#: Chunk of examples per forward in :func:`ir_features`.
FEATURE_BATCH = 1024


@dataclass(frozen=True, eq=False)
class _Memo:
    """One model's features and raw-output digests of every layer on one input tensor."""

    model: weakref.ref[LayeredModel]
    x: torch.Tensor
    versions: tuple[int, ...]
    features: Features
    digests: dict[str, str]

    def holds(self, model: LayeredModel, x: torch.Tensor, versions: tuple[int, ...]) -> bool:
        return self.model() is model and self.x is x and self.versions == versions


_MEMO: list[_Memo] = []


def _versions(model: LayeredModel) -> tuple[int, ...]:
    """The parameters' and buffers' version counters: any in-place change moves one."""
    return tuple(t._version for t in (*model.parameters(), *model.buffers()))


def ir_features(model: LayeredModel, x: torch.Tensor, *, layers: Sequence[str] | None = None,
                batch: int = FEATURE_BATCH, max_flat: int = MAX_FLAT, sort_units: bool = False,
                digests: dict[str, str] | None = None) -> Features:
    """Attack features of every requested layer (all by default) for inputs ``x``.

    Forwarded in chunks of ``batch`` in eval mode (restored afterwards); float32 numpy arrays,
    one row per example, ready for scikit-learn. ``digests``, when given, receives each layer's
    SHA-256 of its raw output (before any reduction) from the same forward pass: equal digests
    of two models on the same inputs mean bit-identical representations, which the audit reads
    as a layer shared by target and references (``trainables.audit.exclusion``).

    With the default reduction (savings on) every layer's features and digests are kept for
    the same model object, unchanged, and input tensor (module docstring); the arrays returned
    are then shared, so they are read-only.
    """
    if sort_units or max_flat != MAX_FLAT or batch != FEATURE_BATCH or not savings_enabled():
        return _ir_features(model, x, layers=layers, batch=batch, max_flat=max_flat,
                            sort_units=sort_units, digests=digests)
    versions = _versions(model)
    _MEMO[:] = [m for m in _MEMO if m.model() is not None]
    memo = next((m for m in _MEMO if m.holds(model, x, versions)), None)
    if memo is None:
        every: dict[str, str] = {}
        feats = _ir_features(model, x, layers=None, batch=batch, max_flat=max_flat,
                             sort_units=False, digests=every)
        for f in feats.values():
            f.flags.writeable = False
        memo = _Memo(model=weakref.ref(model), x=x, versions=versions, features=feats,
                     digests=every)
        _MEMO[:] = [*_MEMO[-(MEMO_ENTRIES - 1):], memo]
    names = list(model.layer_names if layers is None else layers)
    if digests is not None:
        digests.update({name: memo.digests[name] for name in names})
    return {name: memo.features[name] for name in names}


@torch.no_grad()
def _ir_features(model: LayeredModel, x: torch.Tensor, *, layers: Sequence[str] | None,
                 batch: int, max_flat: int, sort_units: bool,
                 digests: dict[str, str] | None) -> Features:
    """:func:`ir_features` computed."""
    names = list(model.layer_names if layers is None else layers)
    was_training = model.training
    model.eval()
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    hashes = {name: hashlib.sha256() for name in names} if digests is not None else {}
    try:
        for start in range(0, x.shape[0], batch):
            _, irs = model.forward_with_irs(x[start:start + batch], layers=names)
            for name in names:
                feats = reduce_ir(irs[name], max_flat=max_flat, sort_units=sort_units)
                parts[name].append(feats.detach().to("cpu", torch.float32).numpy())
                if name in hashes:
                    _digest_update(hashes[name], irs[name])
    finally:
        model.train(was_training)
    if digests is not None:
        digests.update({name: h.hexdigest() for name, h in hashes.items()})
    return {name: (np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32))
            for name, chunks in parts.items()}


def make_attack(*, kind: str = "mlp", seed: int, early_stopping: bool = True) -> Pipeline:
    """An unfitted attack classifier: standardisation, then the classifier ``kind``.

    Standardising matters: IR scales differ by orders of magnitude between layers, and both
    the MLP and the regularised logistic regression assume comparable feature scales.
    ``early_stopping`` (MLP only) holds out a stratified tenth, which needs a few dozen examples.
    """
    clf: ClassifierMixin
    if kind == "mlp":
        clf = MLPClassifier(hidden_layer_sizes=(64,), alpha=1e-3, max_iter=200,
                            early_stopping=early_stopping, random_state=seed)
    elif kind == "logreg":
        clf = LogisticRegression(C=1.0, max_iter=1000)
    else:
        raise UserInputError(field="attack", value=kind, allowed=f"one of {ATTACK_KINDS}")
    return make_pipeline(StandardScaler(), clf)


def balanced_xy(members: np.ndarray, nonmembers: np.ndarray, *, rng: np.random.Generator,
                max_per_class: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stack members (label 1) and non-members (label 0), subsampling the larger class (and
    both to ``max_per_class``)."""
    n = min(len(members), len(nonmembers), max_per_class or len(members))
    if n == 0:
        raise ValueError("an attack needs at least one member and one non-member")
    m = members[rng.choice(len(members), n, replace=False)] if len(members) > n else members
    o = (nonmembers[rng.choice(len(nonmembers), n, replace=False)]
         if len(nonmembers) > n else nonmembers)
    x = np.concatenate([m, o])
    y = np.concatenate([np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64)])
    return x, y


def fit_layer_attacks(features_members: Features, features_nonmembers: Features, *, seed: int,
                      kind: str = "mlp") -> dict[str, Pipeline]:
    """One fitted attack per layer (label 1 = member), each on balanced classes."""
    if features_members.keys() != features_nonmembers.keys():
        raise ValueError("members and non-members must have features for the same layers")
    return {name: fit_layer_attack(features_members[name], features_nonmembers[name],
                                   seed=seed, index=i, kind=kind)
            for i, name in enumerate(features_members)}


def fit_layer_attack(members: np.ndarray, nonmembers: np.ndarray, *, seed: int, index: int,
                     kind: str = "mlp", max_per_class: int | None = None) -> Pipeline:
    """The attack of the ``index``-th layer (its own seeded stream), on balanced classes of at
    most ``max_per_class`` rows each."""
    rng = np.random.default_rng([seed, index])
    x, y = balanced_xy(members, nonmembers, rng=rng, max_per_class=max_per_class)
    attack = make_attack(kind=kind, seed=seed + index, early_stopping=len(y) >= MIN_EARLY_STOP)
    return attack.fit(x, y)


def attack_accuracy(attack: Any, members: np.ndarray, nonmembers: np.ndarray) -> float:
    """Balanced accuracy of an attack on labelled features (0.5 = chance, 1 = perfect)."""
    x = np.concatenate([members, nonmembers])
    y = np.concatenate([np.ones(len(members), np.int64), np.zeros(len(nonmembers), np.int64)])
    return float(balanced_accuracy_score(y, attack.predict(x)))


def attack_error_rate(attack: Any, members: np.ndarray, nonmembers: np.ndarray) -> float:
    """Balanced error rate, 1 - :func:`attack_accuracy`: the paper's ER (lower = leakier)."""
    return 1.0 - attack_accuracy(attack, members, nonmembers)


def layer_accuracies(attacks: dict[str, Any], features_members: Features,
                     features_nonmembers: Features) -> dict[str, float]:
    """Balanced accuracy of each layer's attack on the given members / non-members."""
    return {name: attack_accuracy(clf, features_members[name], features_nonmembers[name])
            for name, clf in attacks.items()}


def split_features(features: Features, *, fraction: float,
                   rng: np.random.Generator) -> tuple[Features, Features]:
    """Split the examples (rows, the same for every layer) into ``fraction`` and the rest."""
    n = len(next(iter(features.values())))
    order = rng.permutation(n)
    k = round(fraction * n)
    first, rest = order[:k], order[k:]
    return ({name: f[first] for name, f in features.items()},
            {name: f[rest] for name, f in features.items()})
