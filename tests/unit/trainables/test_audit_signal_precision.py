"""The audit's float32 gradient-norm path (a rescaled, exactly formed output residual
backpropagated in float32, trainables/audit/signals.py) against known answers and the float64
path: saturated members, tiny and huge norms, and the attacks read off either path."""

from __future__ import annotations

import copy
import functools
import math

import mpmath
import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from dpsweep.trainables.audit import references
from dpsweep.trainables.audit.references import (
    AuditSignals,
    NonPrivateRecipe,
    collect_signals,
    nonprivate_trainer,
    plan_references,
    score_signals,
)
from dpsweep.trainables.audit.signals import (
    FLOAT32_LOG_NORM_TOLERANCE,
    LOG_MIN_GRAD_NORM,
    grad_norm_name,
    logit_confidence,
    per_example_signals,
    scaled_residual,
)
from dpsweep.trainables.data.splits import DataSplits, SplitSizes, load_splits
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.models.networks import LayeredModel

#: Digits of the mpmath known answers.
MP_DIGITS = 60
#: Logit margins beyond float32's p_y = 1 (~17), float64's (~37) and float64's exp range (~745).
SATURATED_MARGINS = (17.5, 40.0, 100.0, 800.0)
SIZES = SplitSizes(train=300, validation=100, holdout=300, test=297, shadow=800)
#: Overfits 300 digits (train loss ~1e-3) in ~5 s on one core.
RECIPE = NonPrivateRecipe(epochs=100, lr=3e-3, batch_size=32)
#: Margins below which the float64 path's residual is accurate (its p_y - 1 is wrong by ~1e-16
#: absolute, e^-20 relative error 5e-8): the rows it can referee.
FLOAT64_ACCURATE_MARGIN = 20.0
#: float32 p_y rounds to 1 from about this margin (-log(2^-24)).
FLOAT32_SATURATED_MARGIN = 24 * math.log(2)
#: Logit scale that takes the overfit digits model's members to margins of 12-27.
LOGIT_SCALE = 3.0


def mp_log_residual_norm(z: list[float], y: int) -> mpmath.mpf:
    """log ||softmax(z) - e_y|| to MP_DIGITS digits."""
    with mpmath.workdps(MP_DIGITS):
        zs = [mpmath.mpf(v) for v in z]
        lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in zs))
        r = [mpmath.exp(v - lse) for v in zs]
        r[y] = -mpmath.fsum(r[j] for j in range(len(zs)) if j != y)  # 1 - p_y, no cancellation
        return mpmath.log(mpmath.sqrt(mpmath.fsum(v * v for v in r)))


def test_scaled_residual_is_the_residual_over_a_power_of_two() -> None:
    z = [[0.0, 0.5, -1.0], *[[m, 0.0, -3.0] for m in SATURATED_MARGINS], [-800.0, 0.0, 0.0]]
    logits = torch.tensor(z, dtype=torch.float32)
    y = torch.zeros(len(z), dtype=torch.long)
    scaled, e = scaled_residual(logits, y)
    assert torch.equal(e, e.round())  # an exact power of two
    top = scaled.abs().amax(dim=1)
    assert ((top >= 0.5 - 1e-12) & (top <= 1.0 + 1e-12)).all()
    assert (scaled[:, 0] < 0).all() and (scaled[:, 1:] >= 0).all()  # p - e_y's signs
    for row, (zi, ei) in enumerate(zip(logits.tolist(), e.tolist(), strict=True)):
        got = math.log(scaled[row].norm().item()) + ei * math.log(2)
        assert got == pytest.approx(float(mp_log_residual_norm(zi, 0)), abs=1e-12), zi


def test_scaled_residual_keeps_non_finite_rows_and_one_class() -> None:
    logits = torch.tensor([[float("nan"), 0.0], [1.0, 2.0]])
    scaled, e = scaled_residual(logits, torch.tensor([0, 1]))
    assert torch.isnan(scaled[0]).all() and e[0] == 0
    assert torch.isfinite(scaled[1]).all()
    one, e1 = scaled_residual(torch.tensor([[3.0]]), torch.tensor([0]))
    assert torch.equal(one, torch.zeros(1, 1)) and e1.item() == 0


def identity_model(classes: int) -> LayeredModel:
    """logits = x: each example's weight gradient is r x^T, its norm ||r|| ||x|| exactly."""
    fc = nn.Linear(classes, classes, bias=False)
    with torch.no_grad():
        fc.weight.copy_(torch.eye(classes))
    return LayeredModel([("fc", fc)], num_classes=classes)


def test_log_norms_match_the_known_answer_saturated_tiny_and_huge() -> None:
    x = torch.tensor([[m, 0.0, -3.0] for m in SATURATED_MARGINS]  # saturated members
                     + [[1e-30, 0.0, 0.0], [3e-38, -1e-38, 0.0]]  # tiny norms
                     + [[-1e30, 0.0, 0.0], [2e37, -2e37, 1e37]])  # huge norms
    y = torch.zeros(len(x), dtype=torch.long)
    got = per_example_signals(model=identity_model(3), x=x, y=y)[grad_norm_name("fc")]
    with mpmath.workdps(MP_DIGITS):
        want = np.array([float(mp_log_residual_norm(row, 0) + mpmath.log(mpmath.sqrt(
            mpmath.fsum(mpmath.mpf(v) ** 2 for v in row)))) for row in x.tolist()])
    # norms below MIN_GRAD_NORM (1e-300: margins past ~690 here) read as the floor
    floored = want < LOG_MIN_GRAD_NORM
    assert floored.tolist() == [False] * 3 + [True] + [False] * 3 + [True]
    np.testing.assert_allclose(got, np.maximum(want, LOG_MIN_GRAD_NORM), rtol=0,
                               atol=FLOAT32_LOG_NORM_TOLERANCE)
    # the float64 cross-entropy backward loses r_y past a margin of ~37: it cannot referee
    exact = per_example_signals(model=identity_model(3), x=x, y=y, exact=True)
    off = np.abs(exact[grad_norm_name("fc")] - np.maximum(want, LOG_MIN_GRAD_NORM))
    assert off[SATURATED_MARGINS.index(40.0)] > 0.1 and off[4:7].max() < 1e-9


@pytest.fixture(scope="module")
def data() -> DataSplits:
    torch.set_num_threads(1)
    return load_splits(dataset="digits", seed=0, sizes=SIZES)


@pytest.fixture(scope="module")
def target(data: DataSplits) -> LayeredModel:
    model, _ = references.train_nonprivate(data=data, recipe=RECIPE, seed=12345)
    return model


def more_confident(model: LayeredModel) -> LayeredModel:
    """``model`` with its logits scaled by ``LOGIT_SCALE`` (the last layer's weight and bias):
    its members' margins (4-9 on the overfit digits model) then reach float32's saturation."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.blocks[out.layer_names[-1]].parameters():
            p.mul_(LOGIT_SCALE)
    return out


def test_float32_path_matches_float64_on_an_overfit_model(data: DataSplits,
                                                          target: LayeredModel) -> None:
    target = more_confident(target)
    x = torch.cat([data.train.x, data.holdout.x])
    y = torch.cat([data.train.y, data.holdout.y])
    fast = per_example_signals(model=target, x=x, y=y)
    exact = per_example_signals(model=target, x=x, y=y, exact=True)
    with torch.no_grad():
        margin = logit_confidence(target(x).double(), y).numpy()
    refereed = margin < FLOAT64_ACCURATE_MARGIN
    saturated = refereed & (margin > FLOAT32_SATURATED_MARGIN)
    assert saturated[:len(data.train)].sum() >= 10  # members whose float32 p_y is 1
    # a plain float32 backward of the cross-entropy gets those members' norms wrong
    naive = GradEngine(target).compute(x, y, live=[True] * len(target.layer_names)).norms
    naive_logs = np.log(np.maximum(naive.numpy(), 1e-300))
    for i, layer in enumerate(target.layer_names):
        name = grad_norm_name(layer)
        np.testing.assert_allclose(fast[name][refereed], exact[name][refereed], rtol=0,
                                   atol=FLOAT32_LOG_NORM_TOLERANCE, err_msg=layer)
        assert np.abs(naive_logs[saturated, i] - exact[name][saturated]).max() > 0.1, layer


def test_attacks_read_the_same_from_either_path(data: DataSplits, target: LayeredModel,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_references(data=data, kind="online", n_references=4, seed=0)
    trained: dict[int, tuple[LayeredModel, float]] = {}
    base = nonprivate_trainer(RECIPE)

    def once(d: DataSplits, seed: int, index: int) -> tuple[LayeredModel, float]:
        if index not in trained:
            trained[index] = base(d, seed, index)
        return trained[index]

    def signals() -> AuditSignals:
        return collect_signals(target=target, data=data, plan=plan, trainer=once)

    fast = signals()
    monkeypatch.setattr(references, "per_example_signals",
                        functools.partial(per_example_signals, exact=True))
    exact = signals()
    names = [grad_norm_name(n) for n in target.layer_names]
    a, b = score_signals(fast, names=names), score_signals(exact, names=names)
    for name in names:
        np.testing.assert_allclose(fast.references[name], exact.references[name], rtol=0,
                                   atol=FLOAT32_LOG_NORM_TOLERANCE, err_msg=name)
        for attack, scores in a[name].items():
            other = b[name][attack].scores
            auc = roc_auc_score(plan.is_member, scores.scores)
            assert auc == pytest.approx(roc_auc_score(plan.is_member, other), abs=2e-3)
            agree = np.mean(scores.decisions() == b[name][attack].decisions())
            assert agree >= 0.99, (name, attack)
