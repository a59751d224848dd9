"""Per-layer shadow-model membership-inference audit of trained models (DESIGN.md, "The audit").

Three levels, each usable on its own:

* :func:`attack_models` — the attack core, independent of how the models were trained: given a
  target model with its members and non-members, and shadow model(s) with theirs, it fits one
  attack classifier per layer on the shadows' IRs (pooled over shadows) and scores it on the
  target's balanced members / non-members; plus a loss-threshold baseline on the output.
* :func:`audit_trial` — a trained trial: shadow models are trained with the trial's own method
  and hyperparameters on halves of the public shadow pool (disjoint from the target's data by
  construction of the splits), the budget re-matched for the shadow's training-set size at the
  same target (epsilon, delta), then the core attack runs; the result fills a results row
  (:func:`fill_row`) and ``audit.json`` (ROC points, for plots without recomputation).
* :func:`audit_run` — every ok trial of a results store whose MIA columns are empty.

Features. A layer's IR comes from :mod:`trainables.layer_attack` (``ir_features``: conv maps of
at most 1,024 values flattened, larger ones reduced to per-channel mean / std / max, as stated and
justified there), and the classifiers are its ``fit_layer_attacks``, so the audit and LM-DP-SGD's
risk estimate attack layers alike. One step is added because the audit *transfers* an attack
from shadow to target, which the risk estimate (attack and evaluation on one shadow) never does:
hidden units of independently trained networks are not aligned (any permutation of a layer's
units is the same network), so an attack on raw IRs fitted on the shadow meets a reshuffled
feature vector on the target and scores at chance (measured on digits: 0.45-0.55 on every
layer, even the overfit model's). The default features are therefore the layer's sorted
activations (:func:`unit_invariant`, per statistic for channel-statistics maps, thinned to 64
order statistics), invariant to unit order, plus the example's one-hot label; the output layer,
whose units are the classes in every model, also gets the true class's logit-scaled confidence
(:func:`logit_confidence`). ``features="raw"`` keeps the raw IRs.

Metrics. Target members and non-members are subsampled (seeded) to the smaller count, so accuracy
is balanced and 0.5 is chance. The 95% interval of an accuracy is the **Wilson score interval**
on k correct out of the n = 2m balanced target examples. Balanced accuracy is the mean of two
binomial proportions (TPR over m members, TNR over m non-members); treating it as one proportion
over 2m is conservative, since p(1-p) >= the mean of p_i(1-p_i) (concavity). The interval covers
the sampling of the target's evaluation examples, not the randomness of shadow training or
attack fitting. TPR at a fixed FPR alpha is the largest TPR among ROC points with FPR <= alpha;
with fewer than 1/alpha non-members that point is below one example, so the result says whether
it is meaningful (1,000 non-members for 0.1%, 100 for 1%).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score, roc_auc_score, roc_curve

from core.errors import UserInputError
from orchestrator.results import TRIALS_DIR, read_results, write_results
from trainables.data import DataSplits, Split, SplitSizes, load_splits
from trainables.layer_attack import balanced_xy, fit_layer_attacks, ir_features, reduce_ir
from trainables.models import DEFAULT_MODEL, LayeredModel, build_model
from trainables.training import (
    TrialSpec,
    load_checkpoint_state,
    load_model,
    train_trial,
)

AUDIT_FILE = "audit.json"
#: Two-sided 95% normal quantile (1.959964...).
Z95 = NormalDist().inv_cdf(0.975)
#: The two false-positive rates the field reports TPR at.
LOW_FPRS = (0.01, 0.001)
#: Attack features per layer: "sorted" (unit-order invariant, transfers from shadow to target)
#: or "raw" (``ir_features`` as is, LM-DP-SGD's risk estimate; transfers poorly).
FEATURE_KINDS = ("sorted", "raw")
#: Order statistics kept per block of sorted features (see :func:`unit_invariant`).
QUANTILES = 64
#: Attack classifier (``trainables.layer_attack.make_attack`` kinds). Logistic regression:
#: on digits it transferred from shadow to target more reliably than the MLP, which fits the
#: shadows' idiosyncrasies (fc2 accuracy 0.63-0.78 vs 0.58-0.71 over split seeds), and it is
#: several times faster.
DEFAULT_ATTACK = "logreg"
#: Column recording why an ok trial's audit failed ('' when it did not).
AUDIT_ERROR_COLUMN = "audit_error"


# --- metrics ------------------------------------------------------------------------------


def wilson_interval(*, successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion: unlike the normal (Wald) interval it
    stays inside [0, 1] and keeps its coverage near 0 and 1, where strong attacks live."""
    if trials <= 0:
        raise ValueError("an interval needs at least one trial")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes {successes} outside 0..{trials}")
    p = successes / trials
    z2n = z * z / trials
    centre = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / trials + z2n / (4 * trials))
    # At k = 0 (k = n) the bound is exactly 0 (1); say so rather than return rounding noise.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def tpr_at_fpr(*, fpr: np.ndarray, tpr: np.ndarray, max_fpr: float) -> float:
    """Largest TPR among ROC points whose FPR is at most ``max_fpr`` (a threshold one could
    actually pick), as in Carlini et al. (2022); 0 when no point qualifies."""
    ok = np.asarray(fpr) <= max_fpr
    return float(np.max(np.asarray(tpr)[ok])) if ok.any() else 0.0


def thin_roc(*, fpr: np.ndarray, tpr: np.ndarray,
             max_points: int = 200) -> tuple[list[float], list[float]]:
    """At most ``max_points`` ROC points for plotting, endpoints kept.

    Half are evenly spaced along the curve, half geometrically from its start, so a log-FPR
    plot (where the low-FPR regime the field cares about is visible) keeps its shape too.
    """
    n = len(fpr)
    if n <= max_points:
        keep = np.arange(n)
    else:
        half = max(2, max_points // 2)
        linear = np.linspace(0, n - 1, half)
        geometric = np.geomspace(1, n - 1, max_points - half)
        keep = np.unique(np.concatenate([[0, n - 1], linear.round(), geometric.round()])
                         .astype(np.int64))[:max_points]
        keep[-1] = n - 1
    return ([float(v) for v in np.asarray(fpr)[keep]],
            [float(v) for v in np.asarray(tpr)[keep]])


@dataclass(frozen=True)
class AttackMetrics:
    """One attack (a layer's classifier, or the loss threshold) on the target's examples."""

    name: str
    index: int  # layer index from the input; -1 for the loss baseline
    accuracy: float  # balanced accuracy
    ci_low: float  # 95% Wilson interval of the accuracy
    ci_high: float
    auc: float
    tpr_at_1pct_fpr: float
    tpr_at_01pct_fpr: float
    tpr_at_1pct_fpr_meaningful: bool
    tpr_at_01pct_fpr_meaningful: bool
    n_members: int
    n_nonmembers: int
    roc_fpr: tuple[float, ...]
    roc_tpr: tuple[float, ...]

    def summary(self) -> dict[str, Any]:
        """The results row's per-layer entry (no ROC points: those go to audit.json)."""
        return {"name": self.name, "index": self.index, "accuracy": self.accuracy,
                "ci_low": self.ci_low, "ci_high": self.ci_high, "auc": self.auc,
                "tpr_at_1pct_fpr": self.tpr_at_1pct_fpr,
                "tpr_at_0.1pct_fpr": self.tpr_at_01pct_fpr,
                "tpr_at_1pct_fpr_meaningful": self.tpr_at_1pct_fpr_meaningful,
                "tpr_at_0.1pct_fpr_meaningful": self.tpr_at_01pct_fpr_meaningful,
                "n_members": self.n_members, "n_nonmembers": self.n_nonmembers}

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "roc_fpr": list(self.roc_fpr), "roc_tpr": list(self.roc_tpr)}


def attack_metrics(*, name: str, index: int, labels: np.ndarray, scores: np.ndarray,
                   predicted: np.ndarray, max_roc_points: int = 200) -> AttackMetrics:
    """Accuracy with its Wilson interval, AUC, TPR at low FPR and thinned ROC of one attack.

    ``labels`` are 1 = member; ``scores`` grow with membership belief; ``predicted`` are the
    attack's hard decisions. Callers balance the classes first (then balanced accuracy is the
    plain accuracy and the interval's k is an integer count of correct decisions).
    """
    labels = np.asarray(labels, dtype=np.int64)
    n_members = int(labels.sum())
    n_nonmembers = int(len(labels) - n_members)
    if n_members == 0 or n_nonmembers == 0:
        raise ValueError("attack metrics need members and non-members")
    accuracy = float(balanced_accuracy_score(labels, predicted))
    n = len(labels)
    low, high = wilson_interval(successes=round(accuracy * n), trials=n)
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    roc_fpr, roc_tpr = thin_roc(fpr=fpr, tpr=tpr, max_points=max_roc_points)
    return AttackMetrics(
        name=name, index=index, accuracy=accuracy, ci_low=low, ci_high=high,
        auc=float(roc_auc_score(labels, scores)),
        tpr_at_1pct_fpr=tpr_at_fpr(fpr=fpr, tpr=tpr, max_fpr=LOW_FPRS[0]),
        tpr_at_01pct_fpr=tpr_at_fpr(fpr=fpr, tpr=tpr, max_fpr=LOW_FPRS[1]),
        tpr_at_1pct_fpr_meaningful=n_nonmembers * LOW_FPRS[0] >= 1,
        tpr_at_01pct_fpr_meaningful=n_nonmembers * LOW_FPRS[1] >= 1,
        n_members=n_members, n_nonmembers=n_nonmembers,
        roc_fpr=tuple(roc_fpr), roc_tpr=tuple(roc_tpr))


def balanced_indices(*, n_members: int, n_nonmembers: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Member and non-member row indices, the larger class subsampled to the smaller count
    (seeded), so an attack's accuracy on them is balanced and 0.5 is chance."""
    index, label = balanced_xy(np.arange(n_members), np.arange(n_nonmembers), rng=rng)
    return index[label == 1], index[label == 0]


# --- the attack core ----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Membership:
    """A model with examples it was trained on (members) and examples it never saw."""

    model: LayeredModel
    members_x: torch.Tensor
    members_y: torch.Tensor
    nonmembers_x: torch.Tensor
    nonmembers_y: torch.Tensor

    @classmethod
    def of(cls, model: LayeredModel, *, members: Split, nonmembers: Split) -> Membership:
        return cls(model=model, members_x=members.x, members_y=members.y,
                   nonmembers_x=nonmembers.x, nonmembers_y=nonmembers.y)


@dataclass(frozen=True)
class MembershipAudit:
    """Per-layer attacks and the loss baseline on one target; timings in seconds."""

    layers: tuple[AttackMetrics, ...]
    loss: AttackMetrics
    loss_threshold: float  # loss <= threshold -> "member", fitted on the shadows
    attack_kind: str
    features: str
    n_shadow_models: int
    n_shadow_members: int  # pooled over shadows, before balancing
    n_shadow_nonmembers: int
    fit_seconds: float  # shadow IRs and losses, classifier and threshold fits
    eval_seconds: float  # target IRs and losses, predictions, metrics

    @property
    def peak(self) -> AttackMetrics:
        """The leakiest layer (first one on ties)."""
        return max(self.layers, key=lambda m: (m.accuracy, -m.index))

    def to_dict(self) -> dict[str, Any]:
        peak = self.peak
        return {"layers": [m.to_dict() for m in self.layers], "loss": self.loss.to_dict(),
                "loss_threshold": (self.loss_threshold if math.isfinite(self.loss_threshold)
                                   else None),
                "attack_kind": self.attack_kind,
                "features": self.features,
                "n_shadow_models": self.n_shadow_models,
                "n_shadow_members": self.n_shadow_members,
                "n_shadow_nonmembers": self.n_shadow_nonmembers,
                "peak_mia_accuracy": peak.accuracy, "peak_layer": peak.name,
                "peak_layer_index": peak.index, "fit_seconds": self.fit_seconds,
                "eval_seconds": self.eval_seconds}


@torch.no_grad()
def per_example_loss(model: LayeredModel, x: torch.Tensor, y: torch.Tensor, *,
                     batch: int = 1024) -> np.ndarray:
    """Cross-entropy of each example under ``model`` (eval mode, restored afterwards)."""
    was_training = model.training
    model.eval()
    try:
        parts = [F.cross_entropy(model(x[i:i + batch]), y[i:i + batch], reduction="none")
                 for i in range(0, x.shape[0], batch)]
    finally:
        model.train(was_training)
    return torch.cat(parts).to("cpu", torch.float64).numpy() if parts else np.zeros(0)


def fit_loss_threshold(*, member_losses: np.ndarray, nonmember_losses: np.ndarray,
                       rng: np.random.Generator) -> float:
    """The loss threshold with the best balanced accuracy on (balanced) shadow examples.

    Members get low loss, so the attack says "member" when loss <= threshold; the threshold
    maximises TPR - FPR (Youden's J) along sklearn's ROC of the score -loss.
    """
    losses, labels = balanced_xy(member_losses, nonmember_losses, rng=rng)
    fpr, tpr, thresholds = roc_curve(labels, -losses)
    return float(-thresholds[int(np.argmax(tpr - fpr))])


def unit_invariant(features: np.ndarray, *, blocks: int = 1,
                   quantiles: int = QUANTILES) -> np.ndarray:
    """Each row's values sorted, separately within ``blocks`` equal-width blocks, and thinned
    to at most ``quantiles`` evenly spaced order statistics per block.

    Independently trained networks compute the same functions with their hidden units (and
    channels) in a different order — the permutation symmetry of the weights — so an attack
    fitted on the shadow's unit 5 says nothing about the target's unit 5, and raw-IR attacks
    transfer at chance. The sorted IR (the empirical quantile function of the layer's
    activations) is invariant to that order and keeps what does transfer: how strongly and how
    sparsely the layer responds. Channel-statistics features (``reduce_ir`` of a large conv
    map: means, stds, maxima) are sorted per statistic. Neighbouring order statistics are
    nearly collinear, so thinning them to ``quantiles`` loses little and keeps the attack's
    width (and fitting time) bounded for wide layers.
    """
    if features.shape[1] % blocks:
        raise ValueError(f"{features.shape[1]} features do not split into {blocks} blocks")
    width = features.shape[1] // blocks
    keep = (np.unique(np.linspace(0, width - 1, quantiles).round().astype(np.int64))
            if width > quantiles else np.arange(width))
    return np.concatenate([np.sort(features[:, b * width:(b + 1) * width], axis=1)[:, keep]
                           for b in range(blocks)], axis=1)


def _stat_blocks(model: LayeredModel, x: torch.Tensor) -> dict[str, int]:
    """Per layer, 3 when ``reduce_ir`` turns its map into channel statistics (mean, std, max
    blocks), 1 when it keeps every value."""
    with torch.no_grad():
        was_training = model.training
        model.eval()
        _, irs = model.forward_with_irs(x[:1])
        model.train(was_training)
    return {name: 1 if reduce_ir(ir).shape[1] == ir[0].numel() else 3
            for name, ir in irs.items()}


def layer_features(model: LayeredModel, x: torch.Tensor, y: torch.Tensor, *, classes: int,
                   features: str) -> dict[str, np.ndarray]:
    """Each layer's attack features: ``ir_features`` (raw), or sorted (see
    :func:`unit_invariant`), with the example's one-hot label appended (the attacker of a
    membership query knows the example's label; Nasr et al. 2019 feed it too)."""
    raw = ir_features(model, x)
    onehot = F.one_hot(y, classes).to(torch.float32).numpy()
    if features == "raw":
        return {name: np.concatenate([f, onehot], axis=1) for name, f in raw.items()}
    if features != "sorted":
        raise UserInputError(field="audit.features", value=features,
                             allowed=f"one of {FEATURE_KINDS}")
    blocks = _stat_blocks(model, x)
    out = {name: np.concatenate([unit_invariant(f, blocks=blocks[name]), onehot], axis=1)
           for name, f in raw.items()}
    last = model.layer_names[-1]
    out[last] = np.concatenate([out[last], logit_confidence(raw[last], y)[:, None]], axis=1)
    return out


def logit_confidence(logits: np.ndarray, y: torch.Tensor) -> np.ndarray:
    """LiRA's logit-scaled confidence log(p_y / (1 - p_y)) = z_y - logsumexp_{j != y} z_j.

    The output layer's units are the classes in every model, so the true class's score is
    aligned across shadow and target (unlike hidden units); this scaling of it is close to
    Gaussian (Carlini et al., 2022), which suits the attack classifiers, where raw
    probabilities pile up at 1 for every confident example.
    """
    z = torch.as_tensor(logits, dtype=torch.float64)
    labels = torch.as_tensor(y, dtype=torch.long)
    true = z.gather(1, labels[:, None])[:, 0]
    others = z.scatter(1, labels[:, None], float("-inf")).logsumexp(dim=1)
    return (true - others).numpy()


def _pooled(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def attack_models(*, target: Membership, shadows: Sequence[Membership], seed: int = 0,
                  kind: str = DEFAULT_ATTACK, features: str = "sorted",
                  max_roc_points: int = 200) -> MembershipAudit:
    """Fit per-layer attacks (and the loss threshold) on the shadows, score them on the target.

    Several shadows' IRs are pooled for fitting (more attack training data, less dependence
    on one shadow's initialisation). Target members / non-members are balanced by seeded
    subsampling to the smaller count.
    """
    if not shadows:
        raise ValueError("the attack needs at least one shadow model")
    names = target.model.layer_names
    for shadow in shadows:
        if shadow.model.layer_names != names:
            raise ValueError(f"shadow layers {shadow.model.layer_names} differ from the "
                             f"target's {names}")
    classes = target.model.num_classes
    t0 = time.perf_counter()
    members = _pooled([layer_features(s.model, s.members_x, s.members_y, classes=classes,
                                 features=features) for s in shadows])
    nonmembers = _pooled([layer_features(s.model, s.nonmembers_x, s.nonmembers_y, classes=classes,
                                    features=features) for s in shadows])
    attacks = fit_layer_attacks(members, nonmembers, seed=seed, kind=kind)
    threshold = fit_loss_threshold(
        member_losses=np.concatenate([per_example_loss(s.model, s.members_x, s.members_y)
                                      for s in shadows]),
        nonmember_losses=np.concatenate([per_example_loss(s.model, s.nonmembers_x,
                                                          s.nonmembers_y) for s in shadows]),
        rng=np.random.default_rng([seed, len(names)]))
    fit_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    idx_m, idx_n = balanced_indices(n_members=len(target.members_y),
                                    n_nonmembers=len(target.nonmembers_y),
                                    rng=np.random.default_rng([seed, len(names) + 1]))
    x = torch.cat([target.members_x[idx_m], target.nonmembers_x[idx_n]])
    y = torch.cat([target.members_y[idx_m], target.nonmembers_y[idx_n]])
    labels = np.concatenate([np.ones(len(idx_m), np.int64), np.zeros(len(idx_n), np.int64)])
    target_features = layer_features(target.model, x, y, classes=classes, features=features)
    layers = []
    for i, name in enumerate(names):
        attack = attacks[name]
        layers.append(attack_metrics(
            name=name, index=i, labels=labels,
            scores=attack.predict_proba(target_features[name])[:, 1],
            predicted=attack.predict(target_features[name]), max_roc_points=max_roc_points))
    losses = per_example_loss(target.model, x, y)
    loss = attack_metrics(name="loss", index=-1, labels=labels, scores=-losses,
                          predicted=(losses <= threshold).astype(np.int64),
                          max_roc_points=max_roc_points)
    eval_seconds = time.perf_counter() - t1
    return MembershipAudit(
        layers=tuple(layers), loss=loss, loss_threshold=threshold, attack_kind=kind,
        features=features,
        n_shadow_models=len(shadows), n_shadow_members=sum(len(s.members_y) for s in shadows),
        n_shadow_nonmembers=sum(len(s.nonmembers_y) for s in shadows),
        fit_seconds=fit_seconds, eval_seconds=eval_seconds)


# --- shadow data and models ----------------------------------------------------------------


def _subset(split: Split, rows: np.ndarray) -> Split:
    index = torch.as_tensor(rows, dtype=torch.long)
    return Split(x=split.x[index], y=split.y[index], indices=split.indices[rows])


def shadow_splits(data: DataSplits, *, members: int, index: int, seed: int) -> DataSplits:
    """The data of shadow model ``index``: the public shadow pool cut by a seeded permutation.

    train = ``members`` pool examples (the shadow's members), holdout = the rest of the pool
    (its non-members), test = the target's test split (only monitored), shadow = the
    non-members again, so methods with ``public`` modes still find public data. Every example
    comes from the shadow pool, so none is a member or non-member of the target.
    """
    pool = len(data.shadow)
    if not 1 <= members <= pool - 1:
        raise UserInputError(field="data.shadow_size", value=pool,
                             allowed=f"a shadow pool of at least {members + 1} examples to "
                                     f"train a shadow on {members} and keep non-members")
    order = np.random.default_rng([seed, index]).permutation(pool)
    train, rest = _subset(data.shadow, order[:members]), _subset(data.shadow, order[members:])
    return dataclasses.replace(data, train=train, holdout=rest, shadow=rest)


def shadow_member_count(data: DataSplits) -> int:
    """Shadow training-set size: the target's, so the shadow overfits like the target, capped
    at half the pool so the shadow keeps as many non-members as members."""
    return max(1, min(len(data.train), len(data.shadow) // 2))


def shadow_seed(*, spec_seed: int, audit_seed: int, index: int) -> int:
    """A per-shadow training seed, distinct from the target's and from other shadows'."""
    return int(np.random.SeedSequence([spec_seed, audit_seed, index, 0x5AD0])
               .generate_state(1)[0] & 0x7FFFFFFF)


def shadow_spec(spec: TrialSpec, *, dataset_size: int, seed: int, index: int,
                cache_dir: Path | None = None, timeout_s: float = 120.0) -> TrialSpec:
    """The target's spec (method, method_params, lr, C, epochs, batch size, momentum, model)
    for a shadow of ``dataset_size`` members, the budget re-matched at the same (epsilon,
    delta): the sampling rate depends on the training-set size, so the target's noise
    multiplier would not spend the same epsilon. Same pieces as ``plan_trial``: Poisson plan,
    the method's noise shape, calibrate, epsilon curve.
    """
    from orchestrator.trial import match_budget

    cal, curve = match_budget(method=spec.method, params=dict(spec.method_params),
                              dataset_size=dataset_size, batch_size=spec.batch_size,
                              epochs=spec.epochs,
                              epsilon=float(spec.calibration["target_epsilon"]),
                              delta=float(spec.calibration["delta"]), cache_dir=cache_dir,
                              timeout_s=timeout_s)
    return dataclasses.replace(
        spec, calibration=cal.to_dict(), epsilon_curve=curve,
        seed=shadow_seed(spec_seed=spec.seed, audit_seed=seed, index=index), sizes=None,
        trial_id=f"{spec.trial_id}-shadow{index}")


@dataclass(frozen=True)
class ShadowRecord:
    """What one shadow model was: its seed, data, budget and how well it learned."""

    index: int
    seed: int
    n_members: int
    n_nonmembers: int
    noise_multiplier: float | None  # None for a non-private shadow
    epsilon_upper: float | None
    test_accuracy: float
    train_seconds: float


@dataclass(frozen=True)
class TrialAudit:
    """The audit of one trained model: the attack, its shadows, and what it cost."""

    trial_id: str
    attack: MembershipAudit
    shadows: tuple[ShadowRecord, ...]
    target_test_accuracy: float | None  # from the target's history, when known
    target_train_seconds: float | None  # the target's training wall time, when known
    shadow_train_seconds: float
    seconds: float  # the whole audit: shadow training + attack fitting + evaluation

    def to_dict(self) -> dict[str, Any]:
        return {"trial_id": self.trial_id, **self.attack.to_dict(),
                "shadows": [dataclasses.asdict(s) for s in self.shadows],
                "target_test_accuracy": self.target_test_accuracy,
                "target_train_seconds": self.target_train_seconds,
                "shadow_train_seconds": self.shadow_train_seconds,
                "audit_seconds": self.seconds}


def fill_row(row: dict[str, Any], audit: TrialAudit) -> dict[str, Any]:
    """A copy of a results row with its MIA columns filled from ``audit``."""
    peak = audit.attack.peak
    return {**row, "peak_mia_accuracy": peak.accuracy, "peak_layer": peak.name,
            "peak_layer_index": peak.index,
            "loss_attack_accuracy": audit.attack.loss.accuracy,
            "loss_attack_auc": audit.attack.loss.auc,
            "mia_layers": json.dumps([m.summary() for m in audit.attack.layers]),
            "audit_seconds": audit.seconds, AUDIT_ERROR_COLUMN: ""}


def fill_row_from_json(row: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """:func:`fill_row` from a stored ``audit.json`` (the sweep's driver reads the file the
    trial wrote, so the row and the file can never disagree)."""
    summary_keys = ("name", "index", "accuracy", "ci_low", "ci_high", "auc",
                    "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr", "tpr_at_1pct_fpr_meaningful",
                    "tpr_at_0.1pct_fpr_meaningful", "n_members", "n_nonmembers")
    layers = [{k: layer[k] for k in summary_keys} for layer in saved["layers"]]
    return {**row, "peak_mia_accuracy": saved["peak_mia_accuracy"],
            "peak_layer": saved["peak_layer"], "peak_layer_index": saved["peak_layer_index"],
            "loss_attack_accuracy": saved["loss"]["accuracy"],
            "loss_attack_auc": saved["loss"]["auc"], "mia_layers": json.dumps(layers),
            "audit_seconds": saved["audit_seconds"], AUDIT_ERROR_COLUMN: ""}


def write_audit_json(audit: TrialAudit, directory: Path) -> Path:
    """``directory/audit.json``: everything in the row plus ROC points per layer and for the
    loss baseline, shadows and timings, so the report plots without recomputing."""
    path = Path(directory) / AUDIT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(audit.to_dict(), indent=1))
    tmp.replace(path)
    return path


def _load_data(spec: TrialSpec) -> DataSplits:
    sizes = SplitSizes(**spec.sizes) if spec.sizes else None
    return load_splits(dataset=spec.dataset, seed=spec.split_seed, sizes=sizes,
                       data_dir=spec.data_dir)


def audit_trial(checkpoint_dir: Path, *, data: DataSplits | None = None, shadow_models: int = 1,
                seed: int = 0, kind: str = DEFAULT_ATTACK, cache_dir: Path | None = None,
                timeout_s: float = 120.0, write_to: Path | None = None) -> TrialAudit:
    """Audit the trial checkpointed in ``checkpoint_dir`` (its spec is read from there).

    Shadows are trained by ``train_trial`` with the trial's spec on :func:`shadow_splits`
    halves of its shadow pool, the budget re-matched by :func:`shadow_spec`. ``data`` are the
    trial's splits (loaded from the spec when None). A missing or corrupt checkpoint is a
    UserInputError naming its path. ``write_to`` receives ``audit.json`` when given.
    """
    if shadow_models < 1:
        raise UserInputError(field="shadow_models", value=shadow_models, allowed="an integer >= 1")
    start = time.perf_counter()
    state = load_checkpoint_state(Path(checkpoint_dir))
    spec = TrialSpec.from_dict(state["spec"])
    data = _load_data(spec) if data is None else data
    target, _ = load_model(Path(checkpoint_dir), data=data, device="cpu")
    n_members = shadow_member_count(data)
    shadows: list[Membership] = []
    records: list[ShadowRecord] = []
    t_shadow = time.perf_counter()
    for k in range(shadow_models):
        sdata = shadow_splits(data, members=n_members, index=k, seed=seed)
        sspec = shadow_spec(spec, dataset_size=n_members, seed=seed, index=k,
                            cache_dir=cache_dir, timeout_s=timeout_s)
        with tempfile.TemporaryDirectory(prefix="dpsweep-shadow-") as tmp:
            result = train_trial(sspec, data=sdata, checkpoint_root=Path(tmp))
            if result.checkpoint_dir is None:
                raise RuntimeError(f"shadow {k} of {spec.trial_id} left no checkpoint")
            model, _ = load_model(result.checkpoint_dir, data=sdata, device="cpu")
        shadows.append(Membership.of(model, members=sdata.train, nonmembers=sdata.holdout))
        records.append(ShadowRecord(
            index=k, seed=sspec.seed, n_members=len(sdata.train), n_nonmembers=len(sdata.holdout),
            noise_multiplier=float(sspec.calibration["schedule"][0]["noise_multiplier"]),
            epsilon_upper=float(result.privacy["epsilon_upper"]),
            test_accuracy=result.test_accuracy, train_seconds=result.seconds))
    shadow_seconds = time.perf_counter() - t_shadow
    attack = attack_models(target=Membership.of(target, members=data.train,
                                                nonmembers=data.holdout),
                           shadows=shadows, seed=seed, kind=kind)
    history = state.get("history") or []
    audit = TrialAudit(
        trial_id=spec.trial_id, attack=attack, shadows=tuple(records),
        target_test_accuracy=float(history[-1]["test_accuracy"]) if history else None,
        target_train_seconds=(float(sum(m["epoch_seconds"] for m in history))
                              if history else None),
        shadow_train_seconds=shadow_seconds, seconds=time.perf_counter() - start)
    if write_to is not None:
        write_audit_json(audit, write_to)
    return audit


# --- a non-private reference (the audit's positive control) --------------------------------


@dataclass(frozen=True)
class NonPrivateRecipe:
    """Plain Adam training without clipping, noise or regularisation: the audit's leaky
    reference, deliberately trained to memorise a small training set."""

    epochs: int = 800
    lr: float = 3e-3
    batch_size: int = 32
    model: str = "auto"
    activation: str = "tanh"


def train_nonprivate(*, data: DataSplits, recipe: NonPrivateRecipe, seed: int,
                     threads: int | None = 1) -> tuple[LayeredModel, float]:
    """(model, seconds): the recipe applied to ``data.train``, shuffled minibatches, CPU.

    ``threads`` sets torch's intra-op threads (None leaves them): one thread is several
    times faster than two for these small models on a shared machine.
    """
    start = time.perf_counter()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    name = DEFAULT_MODEL[data.name] if recipe.model == "auto" else recipe.model
    model = build_model(name=name, input_shape=data.input_shape, num_classes=data.num_classes,
                        activation=recipe.activation)
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr)
    generator = torch.Generator().manual_seed(seed)
    x, y = data.train.x, data.train.y
    model.train()
    for _ in range(recipe.epochs):
        order = torch.randperm(len(y), generator=generator)
        for i in range(0, len(y), recipe.batch_size):
            batch = order[i:i + recipe.batch_size]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    model.eval()
    return model, time.perf_counter() - start


@torch.no_grad()
def accuracy(model: LayeredModel, split: Split) -> float:
    """Top-1 accuracy of ``model`` on ``split``."""
    model.eval()
    return float((model(split.x).argmax(dim=1) == split.y).float().mean())


def audit_nonprivate(data: DataSplits, *, recipe: NonPrivateRecipe, shadow_models: int = 1,
                     seed: int = 0, kind: str = DEFAULT_ATTACK,
                     threads: int | None = 1) -> TrialAudit:
    """Train a non-private target on ``data.train`` and shadows the same way on
    :func:`shadow_splits`, then attack: the positive control that shows the audit works."""
    start = time.perf_counter()
    target, target_seconds = train_nonprivate(data=data, recipe=recipe, seed=seed,
                                              threads=threads)
    n_members = shadow_member_count(data)
    shadows: list[Membership] = []
    records: list[ShadowRecord] = []
    for k in range(shadow_models):
        sdata = shadow_splits(data, members=n_members, index=k, seed=seed)
        sseed = shadow_seed(spec_seed=seed, audit_seed=seed, index=k)
        model, seconds = train_nonprivate(data=sdata, recipe=recipe, seed=sseed,
                                          threads=threads)
        shadows.append(Membership.of(model, members=sdata.train, nonmembers=sdata.holdout))
        records.append(ShadowRecord(
            index=k, seed=sseed, n_members=len(sdata.train), n_nonmembers=len(sdata.holdout),
            noise_multiplier=None, epsilon_upper=None,
            test_accuracy=accuracy(model, sdata.test), train_seconds=seconds))
    attack = attack_models(target=Membership.of(target, members=data.train,
                                                nonmembers=data.holdout),
                           shadows=shadows, seed=seed, kind=kind)
    return TrialAudit(trial_id="nonprivate", attack=attack, shadows=tuple(records),
                      target_test_accuracy=accuracy(target, data.test),
                      target_train_seconds=target_seconds,
                      shadow_train_seconds=sum(r.train_seconds for r in records),
                      seconds=time.perf_counter() - start - target_seconds)


# --- a whole run ----------------------------------------------------------------------------


#: The MIA columns of a trial without an audit (as ``orchestrator.results.row_from_trial``
#: writes them), so a failed re-audit never leaves stale numbers beside its error.
_EMPTY_MIA: dict[str, Any] = {"peak_mia_accuracy": math.nan, "peak_layer": "",
                              "peak_layer_index": -1, "loss_attack_accuracy": math.nan,
                              "loss_attack_auc": math.nan, "mia_layers": "[]",
                              "audit_seconds": math.nan}


def _needs_audit(row: dict[str, Any], *, only_missing: bool) -> bool:
    if row.get("status") != "ok":
        return False
    if not only_missing:
        return True
    peak = row.get("peak_mia_accuracy")
    return peak is None or (isinstance(peak, float) and math.isnan(peak))


def _trial_dir(run: Path, row: dict[str, Any], checkpoint: Path) -> Path:
    named = run / TRIALS_DIR / str(row["trial_id"])
    return named if named.is_dir() else checkpoint


def audit_run(run_dir: Path, *, shadow_models: int = 1, seed: int = 0,
              only_missing: bool = True, kind: str = DEFAULT_ATTACK,
              cache_dir: Path | None = None) -> pd.DataFrame:
    """Audit every ok trial of the results store in ``run_dir`` (only those whose MIA columns
    are empty unless ``only_missing`` is False), rewrite the store, return its new frame.

    Every checkpoint to audit is validated first (a missing or unreadable one is a
    UserInputError naming its path, before hours of shadow training are spent); an audit that
    fails later (e.g. a diverging shadow) is recorded in ``audit_error`` and the others go on.
    """
    if isinstance(shadow_models, bool) or not isinstance(shadow_models, int) or shadow_models < 1:
        raise UserInputError(field="shadow_models", value=shadow_models, allowed="an integer >= 1")
    run = Path(run_dir)
    frame = read_results(run)
    rows = frame.to_dict("records")
    todo: list[tuple[int, Path, TrialSpec]] = []
    for i, row in enumerate(rows):
        if not _needs_audit(row, only_missing=only_missing):
            continue
        checkpoint = run / str(row.get("checkpoint") or "")
        if not row.get("checkpoint") or not checkpoint.is_dir():
            raise UserInputError(field="checkpoint", value=str(checkpoint),
                                 allowed=f"the checkpoint directory of trial "
                                         f"{row['trial_id']!r} (missing)")
        todo.append((i, checkpoint,
                     TrialSpec.from_dict(load_checkpoint_state(checkpoint)["spec"])))
    datasets: dict[str, DataSplits] = {}  # trials of one sweep share their splits
    for i, checkpoint, spec in todo:
        row = rows[i]
        try:
            key = json.dumps([spec.dataset, spec.split_seed, spec.sizes, spec.data_dir])
            if key not in datasets:
                datasets[key] = _load_data(spec)
            audit = audit_trial(checkpoint, data=datasets[key], shadow_models=shadow_models,
                                seed=seed, kind=kind, cache_dir=cache_dir,
                                write_to=_trial_dir(run, row, checkpoint))
            rows[i] = fill_row(row, audit)
        except Exception as exc:  # one trial's failure must not lose the others' audits
            rows[i] = {**row, **_EMPTY_MIA, AUDIT_ERROR_COLUMN: "".join(
                traceback.format_exception_only(type(exc), exc)).strip()}
    for row in rows:
        row.setdefault(AUDIT_ERROR_COLUMN, "")
        if row[AUDIT_ERROR_COLUMN] is None:
            row[AUDIT_ERROR_COLUMN] = ""
    write_results(run, rows)
    return read_results(run)
