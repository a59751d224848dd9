"""Calibrated per-layer membership attacks: signals, scores, reference plans, and the attack on a
deliberately overfit digits model (trainables/audit/)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.door import check
from dpsweep.trainables.audit.plan_statement import plan_statement
from dpsweep.trainables.audit.references import (
    DEFAULT_POPULATION,
    AuditSignals,
    NonPrivateRecipe,
    ReferencePlan,
    collect_signals,
    nonprivate_trainer,
    plan_references,
    reference_data,
    reference_seed,
    score_signals,
    train_nonprivate,
)
from dpsweep.trainables.audit.scores import (
    LIRA_OFFLINE,
    LIRA_ONLINE,
    LIRA_POOLED,
    LOSS_THRESHOLD,
    RMIA,
    SignalObservations,
    attack_signal,
    best_threshold,
    difficulty_bins,
    lira_offline,
    lira_online,
    lira_pooled,
    rmia_log_ratio,
    rmia_score,
)
from dpsweep.trainables.audit.signals import (
    FLOAT32_LOG_NORM_TOLERANCE,
    LOGIT,
    LOSS,
    grad_norm_name,
    member_direction,
    membership_probability,
    per_example_signals,
    rmia_input,
)
from dpsweep.trainables.data.splits import DataSplits, SplitSizes, load_splits
from dpsweep.trainables.models.networks import LayeredModel

#: 300 members and 300 non-members; the pool holds the offline references' data.
SIZES = SplitSizes(train=300, validation=100, holdout=300, test=297, shadow=800)
#: Overfits 300 digits (train loss ~1e-3) in ~5 s on one core.
RECIPE = NonPrivateRecipe(epochs=100, lr=3e-3, batch_size=32)
REFERENCES = 4
#: Acceptance on the overfit model: the best per-layer attack's accuracy at its own threshold.
MIN_BEST_ACCURACY = 0.6
#: The float32 path's logit and loss against the float64 path's, absolute: float32 logits.
OUTPUT_TOLERANCE = 1e-5
#: A null AUC must stay within this many standard errors of 0.5 (Hanley-McNeil at AUC 0.5).
NULL_Z = 4.0


def null_auc_se(n_pos: int, n_neg: int) -> float:
    """Standard error of the AUC of an uninformative score (Mann-Whitney U under H0)."""
    return math.sqrt((n_pos + n_neg + 1) / (12 * n_pos * n_neg))


@pytest.fixture(scope="module")
def data() -> DataSplits:
    torch.set_num_threads(1)
    return load_splits(dataset="digits", seed=0, sizes=SIZES)


@pytest.fixture(scope="module")
def target(data: DataSplits) -> LayeredModel:
    model, _ = train_nonprivate(data=data, recipe=RECIPE, seed=12345)
    return model


@pytest.fixture(scope="module")
def online(data: DataSplits, target: LayeredModel) -> AuditSignals:
    plan = plan_references(data=data, kind="online", n_references=REFERENCES, seed=0)
    return collect_signals(target=target, data=data, plan=plan, trainer=nonprivate_trainer(RECIPE))


# --- signals ---------------------------------------------------------------------------------


def permute_units(model: LayeredModel, *, seed: int) -> LayeredModel:
    """digits_cnn with the channels of conv1 and conv2 and the units of fc1 permuted
    consistently (each layer's outputs and the next layer's inputs): the same function."""
    g = torch.Generator().manual_seed(seed)
    p1, p2, p3 = (torch.randperm(n, generator=g) for n in (16, 32, 32))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["blocks.conv1.0.weight"] = sd["blocks.conv1.0.weight"][p1]
    sd["blocks.conv1.0.bias"] = sd["blocks.conv1.0.bias"][p1]
    sd["blocks.conv2.0.weight"] = sd["blocks.conv2.0.weight"][:, p1][p2]
    sd["blocks.conv2.0.bias"] = sd["blocks.conv2.0.bias"][p2]
    fc1 = sd["blocks.fc1.1.weight"].reshape(32, 32, 4)[:, p2].reshape(32, 128)  # [out, c*4+s]
    sd["blocks.fc1.1.weight"] = fc1[p3]
    sd["blocks.fc1.1.bias"] = sd["blocks.fc1.1.bias"][p3]
    sd["blocks.fc2.0.weight"] = sd["blocks.fc2.0.weight"][:, p3]
    out = copy.deepcopy(model)
    out.load_state_dict(sd)
    return out


def test_signals_invariant_to_permuting_hidden_units(data: DataSplits,
                                                     target: LayeredModel) -> None:
    permuted = permute_units(target, seed=3)
    x, y = data.holdout.x[:200], data.holdout.y[:200]
    assert not torch.equal(permuted.state_dict()["blocks.fc1.1.weight"],
                           target.state_dict()["blocks.fc1.1.weight"])
    with torch.no_grad():
        torch.testing.assert_close(permuted(x), target(x), rtol=1e-5, atol=1e-5)
    a = per_example_signals(model=target, x=x, y=y, exact=True)
    b = per_example_signals(model=permuted, x=x, y=y, exact=True)
    assert set(a) == {LOGIT, LOSS, *(grad_norm_name(n) for n in target.layer_names)}
    for name in a:
        # float32 weights permuted exactly; float64 signals agree to summation-order rounding.
        np.testing.assert_allclose(a[name], b[name], rtol=1e-9, atol=1e-9, err_msg=name)
    # the default float32 path: to float32 rounding of a different summation order
    a = per_example_signals(model=target, x=x, y=y)
    b = per_example_signals(model=permuted, x=x, y=y)
    for name in a:
        tol = FLOAT32_LOG_NORM_TOLERANCE if name.startswith("grad_norm") else OUTPUT_TOLERANCE
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=tol, err_msg=name)


def vmap_layer_norms(model: LayeredModel, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """[N, L] per-example per-layer gradient norms by torch.func.vmap(grad), float64."""
    from torch.func import functional_call, grad, vmap

    m = copy.deepcopy(model).double().eval()
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(m, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y)
    layer_of = m.layer_of_parameter()
    sq = torch.zeros(x.shape[0], len(m.layer_names), dtype=torch.float64)
    for name, g in grads.items():
        sq[:, layer_of[name]] += g.flatten(1).pow(2).sum(dim=1)
    return sq.sqrt().numpy()


def test_grad_norm_logit_and_loss_signals_are_exact(data: DataSplits,
                                                    target: LayeredModel) -> None:
    x = torch.cat([data.train.x[:60], data.holdout.x[:60]])
    y = torch.cat([data.train.y[:60], data.holdout.y[:60]])
    signals = per_example_signals(model=target, x=x, y=y, batch=50, exact=True)  # 50, 50, 20
    reference = vmap_layer_norms(target, x, y)
    for i, layer in enumerate(target.layer_names):
        np.testing.assert_allclose(signals[grad_norm_name(layer)], np.log(reference[:, i]),
                                   rtol=0, atol=1e-8, err_msg=layer)
    with torch.no_grad():
        logits = copy.deepcopy(target).double()(x.double())
    p = logits.softmax(dim=1).gather(1, y[:, None])[:, 0].numpy()
    np.testing.assert_allclose(signals[LOSS], -np.log(p), rtol=1e-10)
    # The logit signal is log(p/(1-p)) also where 1 - p is below float64 resolution.
    confident = p < 1 - 1e-6
    np.testing.assert_allclose(signals[LOGIT][confident], np.log(p / (1 - p))[confident],
                               rtol=1e-6)
    assert np.isfinite(signals[LOGIT]).all()
    # Members of an overfit model have smaller gradients in every layer (on average more than
    # e-fold: digits non-members are mostly fitted too, the gap is in their tail).
    for layer in target.layer_names:
        g = signals[grad_norm_name(layer)]
        assert g[:60].mean() < g[60:].mean() - 1.0, layer


def test_directions_and_probabilities() -> None:
    assert member_direction(LOGIT) == 1
    assert member_direction(LOSS) == -1
    assert member_direction(grad_norm_name("conv1")) == -1
    np.testing.assert_allclose(membership_probability(name=LOGIT, values=np.array([0.0, 2.0])),
                               [0.5, 1 / (1 + math.exp(-2))])
    np.testing.assert_allclose(membership_probability(name=LOSS, values=np.array([math.log(4)])),
                               [0.25])
    # ||g|| = 3 -> 1 / (1 + 3)
    np.testing.assert_allclose(
        membership_probability(name=grad_norm_name("fc1"), values=np.array([math.log(3)])),
        [0.25])
    with pytest.raises(UserInputError):
        member_direction("grad_norm")
    with pytest.raises(UserInputError):
        member_direction("margin")


# --- scores: analytic answers ----------------------------------------------------------------


def paired_references(mu_in: np.ndarray, mu_out: np.ndarray, *, d_in: float,
                      d_out: float) -> tuple[np.ndarray, np.ndarray]:
    """Four references per candidate: IN values mu_in +- d_in, OUT values mu_out +- d_out, so the
    per-candidate means are mu_in, mu_out and the within-candidate variances 2 d^2."""
    n = len(mu_in)
    refs = np.stack([mu_in + d_in, mu_in - d_in, mu_out + d_out, mu_out - d_out])
    mask = np.zeros((4, n), dtype=bool)
    mask[:2] = True
    order = np.random.default_rng(0).permutation(4)  # mask rows need not come first
    return refs[order], mask[order]


def test_lira_online_is_the_gaussian_log_likelihood_ratio() -> None:
    mu_in = np.array([2.0, -1.0, 0.5])
    mu_out = np.array([0.0, -3.0, 0.5])
    refs, mask = paired_references(mu_in, mu_out, d_in=0.5, d_out=1.0)
    t = np.array([1.0, -1.5, 3.0])
    var_in, var_out = 2 * 0.5**2, 2 * 1.0**2
    expected = (-(t - mu_in) ** 2 / (2 * var_in) - 0.5 * np.log(var_in)
                + (t - mu_out) ** 2 / (2 * var_out) + 0.5 * np.log(var_out))
    np.testing.assert_allclose(lira_online(target=t, references=refs, in_mask=mask), expected,
                               rtol=1e-12)
    # Per-example variances: candidate 0 with wider IN values than the others.
    refs2 = refs.copy()
    refs2[mask[:, 0], 0] = mu_in[0] + np.array([2.0, -2.0])
    per = lira_online(target=t, references=refs2, in_mask=mask, variance="per_example")
    v0 = 2 * 2.0**2
    assert per[0] == pytest.approx(-(t[0] - mu_in[0]) ** 2 / (2 * v0) - 0.5 * np.log(v0)
                                   + (t[0] - mu_out[0]) ** 2 / (2 * var_out)
                                   + 0.5 * np.log(var_out), rel=1e-12)
    # Global variance pools the within-candidate variances: (8 + 0.5 + 0.5) / 3 for IN.
    glob = lira_online(target=t, references=refs2, in_mask=mask, variance="global")
    vg = (v0 + 2 * var_in) / 3
    assert glob[1] == pytest.approx(-(t[1] - mu_in[1]) ** 2 / (2 * vg) - 0.5 * np.log(vg)
                                    + (t[1] - mu_out[1]) ** 2 / (2 * var_out)
                                    + 0.5 * np.log(var_out), rel=1e-12)


def test_lira_offline_and_rmia_analytic() -> None:
    mu_out = np.array([1.0, -2.0])
    refs = np.stack([mu_out + 0.3, mu_out - 0.3, mu_out + 0.6, mu_out - 0.6])  # var 0.15
    t = np.array([0.0, -1.0])
    sd = math.sqrt((0.09 * 2 + 0.36 * 2) / 3)
    np.testing.assert_allclose(lira_offline(target=t, references=refs, direction=-1),
                               -(t - mu_out) / sd, rtol=1e-12)
    np.testing.assert_allclose(lira_offline(target=t, references=refs, direction=1),
                               (t - mu_out) / sd, rtol=1e-12)
    # RMIA offline: Pr(x) = ((1 + a) Pr_OUT + 1 - a) / 2 = (1.4 * 0.5 + 0.6) / 2 = 0.65.
    p_out = np.full((4, 1), 0.5)
    assert rmia_log_ratio(target=np.array([0.9]), references=p_out, a=0.4)[0] == \
        pytest.approx(math.log(0.9 / 0.65), rel=1e-12)
    # RMIA online: Pr(x) = (Pr_IN + Pr_OUT) / 2 = (0.8 + 0.4) / 2.
    p = np.array([[0.8], [0.8], [0.4], [0.4]])
    mask = np.array([[True], [True], [False], [False]])
    assert rmia_log_ratio(target=np.array([0.9]), references=p, in_mask=mask, a=0.4)[0] == \
        pytest.approx(math.log(0.9 / 0.6), rel=1e-12)
    # Score_MIA: the fraction of z with LR(x, z) >= gamma.
    lz = np.log(np.array([0.5, 1.0, 2.0, 4.0]))
    np.testing.assert_allclose(rmia_score(log_ratio=np.log(np.array([1.0, 3.0, 0.1])),
                                          population_log_ratio=lz, gamma=1.0),
                               [0.5, 0.75, 0.0])
    np.testing.assert_allclose(rmia_score(log_ratio=np.log(np.array([4.0])),
                                          population_log_ratio=lz, gamma=2.0), [0.75])


def test_best_threshold_maximises_balanced_accuracy() -> None:
    scores = np.array([0.1, 0.2, 0.35, 0.4, 0.8, 0.9])
    labels = np.array([0, 0, 1, 0, 1, 1])
    assert best_threshold(scores=scores, labels=labels) == pytest.approx(0.275)  # J = 2/3


# --- scores: nulls and power on synthetic signals --------------------------------------------


def synthetic(rng: np.random.Generator, *, n: int, k: int, shift: float,
              member_target: bool) -> tuple[SignalObservations, np.ndarray]:
    """Candidates with heterogeneous difficulty (per-candidate means spread 2 sd), references
    trained on complementary halves; membership lowers the signal by ``shift`` (like a loss).
    The target trains on a random half when ``member_target``, else is one more OUT model."""
    base = rng.normal(0.0, 2.0, n)
    in_mask = np.zeros((k, n), dtype=bool)
    for j in range(0, k, 2):
        half = rng.permutation(n)[: n // 2]
        in_mask[j, half] = True
        in_mask[j + 1] = ~in_mask[j]
    refs = base + rng.normal(0.0, 0.5, (k, n)) - shift * in_mask
    labels = np.zeros(n, dtype=np.int64)
    labels[rng.permutation(n)[: n // 2]] = 1
    t = base + rng.normal(0.0, 0.5, n) - (shift * labels if member_target else 0.0)
    pop_mask = np.zeros((k, n), dtype=bool)
    obs = SignalObservations(
        name="synthetic", direction=-1, probability=lambda v: 1 / (1 + np.exp(v)), target=t,
        references=refs, in_mask=in_mask, population_references=refs, population_in_mask=pop_mask)
    return obs, labels


def test_null_target_is_at_chance_over_repeats() -> None:
    rng = np.random.default_rng(7)
    n, repeats = 1000, 20
    se = null_auc_se(n // 2, n // 2)
    aucs: dict[str, list[float]] = {LIRA_ONLINE: [], LIRA_POOLED: [], LIRA_OFFLINE: [], RMIA: []}
    for _ in range(repeats):
        obs, labels = synthetic(rng, n=n, k=8, shift=1.0, member_target=False)
        for name, a in attack_signal(obs).items():
            aucs[name].append(roc_auc_score(labels, a.scores))
    for name, values in aucs.items():
        v = np.asarray(values)
        assert np.abs(v - 0.5).max() < NULL_Z * se, (name, v)
        # The mean of 20 independent nulls: standard error se / sqrt(20).
        assert abs(v.mean() - 0.5) < NULL_Z * se / math.sqrt(repeats), (name, v.mean())


def test_member_target_is_detected_and_thresholds_are_sensible() -> None:
    rng = np.random.default_rng(11)
    obs, labels = synthetic(rng, n=2000, k=8, shift=1.0, member_target=True)
    scored = attack_signal(obs)
    # With known per-candidate means, the shift is d = 1 / 0.5 = 2 standard deviations:
    # the Bayes accuracy is Phi(1) = 0.841; estimated means from 4 refs per side cost a little.
    for name in (LIRA_ONLINE, LIRA_POOLED):
        online = scored[name]
        assert roc_auc_score(labels, online.scores) > 0.85, name
        assert 0.78 < (online.decisions() == labels).mean() <= 0.85, name
    for name in (LIRA_OFFLINE, RMIA):
        assert roc_auc_score(labels, scored[name].scores) > 0.8, name
        assert (scored[name].decisions() == labels).mean() > 0.72, name



def test_difficulty_bins_hold_equal_counts_even_with_ties() -> None:
    values = np.r_[np.zeros(60), np.arange(40.0)]
    group = difficulty_bins(values, bins=4, min_per_bin=25)
    assert np.bincount(group).tolist() == [25, 25, 25, 25]
    assert (np.diff(group[np.argsort(values, kind="stable")]) >= 0).all()
    # too few candidates for the bins asked: fewer, fuller bins
    assert np.bincount(difficulty_bins(values, bins=20, min_per_bin=25)).tolist() == [25] * 4


def _tpr_at_1pct(scores: np.ndarray, labels: np.ndarray) -> float:
    return float((scores[labels] > np.quantile(scores[~labels], 0.99)).mean())


def test_pooling_the_shift_finds_more_members_with_four_references() -> None:
    """The shift membership causes varies smoothly with difficulty; with 2 IN and 2 OUT
    references per candidate, per-candidate LiRA estimates it from 4 noisy values, the pooled
    attack from the ~100 candidates of its difficulty bin: a higher AUC in every repeat and
    more members found at 1% FPR over the repeats, and with known means and shift (the oracle)
    no better than that."""
    rng = np.random.default_rng(3)
    n, k, sd = 2000, 4, 0.5
    tprs: dict[str, list[float]] = {"plain": [], "pooled": [], "oracle": []}
    for _ in range(7):
        base = rng.normal(0.0, 2.0, n)
        shift = 0.6 + 0.3 * np.tanh(base)
        in_mask = np.zeros((k, n), dtype=bool)
        for j in range(0, k, 2):
            in_mask[j, rng.permutation(n)[: n // 2]] = True
            in_mask[j + 1] = ~in_mask[j]
        refs = base + rng.normal(0.0, sd, (k, n)) - shift * in_mask
        labels = rng.permutation(np.r_[np.ones(n // 2), np.zeros(n // 2)]).astype(bool)
        t = base + rng.normal(0.0, sd, n) - shift * labels
        scores = {"plain": lira_online(target=t, references=refs, in_mask=in_mask,
                                       variance="global"),
                  "pooled": lira_pooled(target=t, references=refs, in_mask=in_mask),
                  "oracle": (t - base) ** 2 - (t - base + shift) ** 2}
        auc = {name: roc_auc_score(labels, v) for name, v in scores.items()}
        assert auc["plain"] < auc["pooled"] <= auc["oracle"] + 0.01, auc
        for name, v in scores.items():
            tprs[name].append(_tpr_at_1pct(v, labels))
    median = {name: float(np.median(v)) for name, v in tprs.items()}
    assert median["plain"] < median["pooled"] <= median["oracle"], median

# --- reference plans -------------------------------------------------------------------------


def test_plans(data: DataSplits) -> None:
    on = plan_references(data=data, kind="online", n_references=6, seed=1)
    assert on.reference_size == 300 and on.note == ""
    assert (on.in_mask.sum(axis=0) == 3).all()  # complementary halves: IN for exactly K/2
    assert on.is_member.sum() == 300 and len(on.candidates) == 600
    # nothing an online plan runs reads a population: none is drawn (or computed per model)
    assert len(on.population) == 0 and on.population_in_mask.shape == (6, 0)
    off = plan_references(data=data, kind="offline", n_references=4, seed=1)
    assert not off.in_mask.any()
    assert len(off.population) == min(DEFAULT_POPULATION, len(data.shadow))
    assert not np.isin(off.population.indices, np.r_[data.train.indices,
                                                     data.holdout.indices]).any()
    assert off.reference_size == 300  # 2 x 300 <= 800 pool examples
    r0 = reference_data(off, data, index=0)
    assert not np.isin(r0.train.indices, np.r_[data.train.indices, data.holdout.indices]).any()
    assert not np.isin(r0.shadow.indices, r0.train.indices).any()
    np.testing.assert_array_equal(off.population_in_mask[0],
                                  np.isin(off.population.indices, r0.train.indices))
    small = load_splits(dataset="digits", seed=0, sizes=SplitSizes(
        train=300, validation=100, holdout=300, test=297, shadow=500))
    half = plan_references(data=small, kind="offline", n_references=4, seed=1)
    assert half.reference_size == 250 and "half the pool" in half.note
    seeds = {reference_seed(audit_seed=0, index=k) for k in range(8)}
    assert len(seeds) == 8
    with pytest.raises(UserInputError):
        plan_references(data=data, kind="shadow", n_references=4, seed=0)
    with pytest.raises(UserInputError):
        plan_references(data=data, kind="online", n_references=2, seed=0)


# --- end to end on an overfit digits model ----------------------------------------------------


def test_overfit_digits_per_layer_attack_beats_chance(online: AuditSignals,
                                                      target: LayeredModel) -> None:
    labels = online.plan.is_member
    scored = score_signals(online)
    best = max(((name, attack, float((a.decisions() == labels).mean()))
                for name, attacks in scored.items() if name.startswith("grad_norm")
                for attack, a in attacks.items()), key=lambda r: r[2])
    assert best[2] > MIN_BEST_ACCURACY, best
    for layer in target.layer_names:  # every layer leaks through its gradient norm
        auc = roc_auc_score(labels, scored[grad_norm_name(layer)][LIRA_ONLINE].scores)
        assert auc > 0.65, (layer, auc)
    baseline = scored[LOSS][LOSS_THRESHOLD]
    assert roc_auc_score(labels, scored[grad_norm_name("fc1")][LIRA_ONLINE].scores) > \
        roc_auc_score(labels, baseline.scores)


def test_real_null_model_is_at_chance(online: AuditSignals, data: DataSplits) -> None:
    """A model trained on public pool data only (like an offline reference) plays the target:
    none of the candidates is its member, so attacks score at chance."""
    plan: ReferencePlan = online.plan
    pool_only = reference_data(plan_references(data=data, kind="offline", n_references=4,
                                               seed=5), data, index=0)
    null_model, _ = train_nonprivate(data=pool_only, recipe=RECIPE, seed=777)
    own = per_example_signals(model=null_model, x=plan.candidates.x, y=plan.candidates.y)
    labels = plan.is_member
    se = null_auc_se(int(labels.sum()), int((1 - labels).sum()))
    for name in (grad_norm_name("conv1"), grad_norm_name("fc2"), LOGIT):
        obs = online.observations(name)
        obs = SignalObservations(
            name=name, direction=obs.direction, probability=obs.probability, target=own[name],
            references=obs.references, in_mask=obs.in_mask,
            population_references=obs.population_references,
            population_in_mask=obs.population_in_mask)
        for attack, a in attack_signal(obs, attacks=(LIRA_ONLINE, RMIA)).items():
            auc = roc_auc_score(labels, a.scores)
            assert abs(auc - 0.5) < NULL_Z * se, (name, attack, auc)


# --- DP references: dpsweep's own loop, a budget matched for the reference's size -------------


def test_dp_references_use_the_supplied_budget_and_their_own_seed() -> None:
    from dpsweep.orchestrator.trial.plan import match_budget, plan_trial
    from dpsweep.trainables.audit.references import Budget, dp_trainer, reference_spec
    from tests.conftest import tiny_config

    digits = load_splits(dataset="digits", seed=0)  # train 500, shadow pool 500
    spec = plan_trial(check(tiny_config()), trial_id="dp", data=digits)
    asked: list[int] = []

    def budgets(size: int) -> Budget:
        asked.append(size)
        cal, curve = match_budget(
            method=spec.method, params=dict(spec.method_params), dataset_size=size,
            batch_size=spec.batch_size, epochs=spec.epochs,
            epsilon=spec.calibration.target_epsilon,
            delta=spec.calibration.delta, cache_dir=None, timeout_s=120.0)
        return Budget(calibration=cal, epsilon_curve=curve)

    plan = plan_references(data=digits, kind="offline", n_references=4, seed=2)
    assert plan.reference_size == 250 and "half the pool" in plan.note
    rdata = reference_data(plan, digits, index=1)
    seed = reference_seed(audit_seed=2, index=1)
    model, seconds = dp_trainer(spec, budgets=budgets)(rdata, seed, 1)
    assert asked == [250] and seconds > 0
    rspec = reference_spec(spec, dataset_size=250, budgets=budgets, seed=seed, index=1)
    assert rspec.calibration.sample_rate == pytest.approx(1 / math.ceil(250 / 50))
    assert rspec.calibration.sample_rate != spec.calibration.sample_rate
    assert (rspec.seed, rspec.trial_id, rspec.method) == (seed, "dp-ref1", spec.method)
    assert rspec.calibration.target_epsilon == spec.calibration.target_epsilon
    with torch.no_grad():
        assert torch.isfinite(model(rdata.test.x)).all()
    with pytest.raises(UserInputError):
        reference_spec(spec, dataset_size=250, budgets={500: Budget(calibration={},
                                                                    epsilon_curve=[])},
                       seed=seed, index=1)


# --- RMIA once on the output; what a plan can see ---------------------------------------------


def test_rmia_on_logit_and_on_loss_is_one_attack_and_runs_once(online: AuditSignals) -> None:
    """sigmoid(z_y - logsumexp_{j != y} z_j) and exp(-cross-entropy) are both the true-class
    softmax probability, and RMIA reads nothing else: its scores on the two signals agree to
    rounding, so the audit runs it on ``logit`` only (Holm would count it twice)."""
    p_logit = membership_probability(name=LOGIT, values=online.target[LOGIT])
    p_loss = membership_probability(name=LOSS, values=online.target[LOSS])
    np.testing.assert_allclose(p_logit, p_loss, rtol=1e-9, atol=0)
    rmia = {name: attack_signal(online.observations(name), attacks=(RMIA,))[RMIA].scores
            for name in (LOGIT, LOSS)}
    np.testing.assert_allclose(rmia[LOGIT], rmia[LOSS], rtol=1e-9, atol=1e-12)
    scored = score_signals(online)
    assert set(scored[LOGIT]) == {LIRA_ONLINE, LIRA_POOLED, LIRA_OFFLINE, RMIA}
    assert set(scored[LOSS]) == {LIRA_ONLINE, LIRA_POOLED, LIRA_OFFLINE, LOSS_THRESHOLD}
    # LiRA on the two signals differs (different transforms of the probability, Gaussian fits)
    assert not np.allclose(scored[LOGIT][LIRA_ONLINE].scores, scored[LOSS][LIRA_ONLINE].scores)
    # asked for the loss alone, RMIA runs on it; every per-layer signal keeps its own RMIA
    assert RMIA in score_signals(online, names=[LOSS])[LOSS]
    assert rmia_input(LOSS) == LOGIT and rmia_input(grad_norm_name("fc1")) == "grad_norm:fc1"
    assert RMIA in scored[grad_norm_name("fc1")]


def test_the_plan_statement_says_what_each_plan_can_and_cannot_see() -> None:
    offline = plan_statement(kind="offline", n_references=4)
    assert offline.startswith("Offline audit, 4 reference models trained on the public pool")
    assert "online LiRA is not run" in offline
    assert "4 offline references (this plan) reached 0.10 (0.07-0.15)" in offline
    assert "16 online references reached 0.18 (0.14-0.20)" in offline
    assert "pooled variance" in offline and "not a privacy guarantee" in offline
    online = plan_statement(kind="online", n_references=16)
    assert "compared with 8 models that trained on it" in online
    assert "16 online references (this plan) reached 0.18" in online
    assert "4 online references reached 0.16 (0.11-0.18)" in online
    assert "pooled variance" not in plan_statement(kind="online", n_references=64)
    with pytest.raises(UserInputError):
        plan_statement(kind="shadow", n_references=4)
