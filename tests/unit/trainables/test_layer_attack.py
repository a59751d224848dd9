"""Per-layer membership attacks: the IR reduction, balancing, and attack accuracy extremes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.audit.layer_attack import (
    attack_accuracy,
    attack_error_rate,
    balanced_xy,
    fit_layer_attacks,
    ir_features,
    layer_accuracies,
    make_attack,
    reduce_ir,
    split_features,
)
from dpsweep.trainables.models.networks import cnn28, digits_cnn, resnet20_gn

# Two examples, 2 channels, 2x2 maps (8 values each).
MAP = torch.tensor([
    [[[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 8.0]]],
    [[[-1.0, -1.0], [-1.0, -1.0]], [[5.0, 1.0], [1.0, 1.0]]],
])


def test_small_map_is_flattened() -> None:
    raw = reduce_ir(MAP, max_flat=8)
    assert torch.equal(raw, MAP.reshape(2, 8))
    ordered = reduce_ir(MAP, max_flat=8, sort_units=True)
    assert torch.equal(ordered[0], torch.tensor([8.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(ordered[1], torch.tensor([5.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]))


def test_large_map_becomes_per_channel_statistics() -> None:
    raw = reduce_ir(MAP, max_flat=7)  # 8 values > 7: statistics
    assert raw.shape == (2, 6)  # [mean_c, std_c, max_c] for C = 2
    std_a = float(np.std([1.0, 2.0, 3.0, 4.0]))
    std_b = float(np.std([0.0, 0.0, 0.0, 8.0]))
    std_d = float(np.std([5.0, 1.0, 1.0, 1.0]))
    expected = torch.tensor([[2.5, 2.0, std_a, std_b, 4.0, 8.0],
                             [-1.0, 2.0, 0.0, std_d, -1.0, 5.0]])
    assert torch.allclose(raw, expected)
    ordered = reduce_ir(MAP, max_flat=7, sort_units=True)  # each statistic across channels
    assert torch.allclose(ordered[0], torch.tensor([2.5, 2.0, std_b, std_a, 8.0, 4.0]))
    assert torch.allclose(ordered[1], torch.tensor([2.0, -1.0, std_d, 0.0, 5.0, -1.0]))


def test_sorted_features_ignore_a_unit_permutation() -> None:
    x = torch.randn(5, 3, 4, 4)
    perm = torch.tensor([2, 0, 1])
    for max_flat in (48, 10):  # flattened, then per-channel statistics
        assert torch.equal(reduce_ir(x, max_flat=max_flat, sort_units=True),
                           reduce_ir(x[:, perm], max_flat=max_flat, sort_units=True))
    dense = torch.randn(5, 7)
    assert torch.equal(reduce_ir(dense, sort_units=True),
                       reduce_ir(dense[:, torch.randperm(7)], sort_units=True))
    assert torch.equal(reduce_ir(dense), dense)


@pytest.mark.parametrize("factory, shape, widths", [
    (digits_cnn, (1, 8, 8), {"conv1": 256, "conv2": 128, "fc1": 32, "fc2": 10}),
    (cnn28, (1, 28, 28), {"conv1": 48, "conv2": 512, "fc1": 32, "fc2": 10}),
    # GroupNorm ResNet: maps of 16x32x32, 32x16x16 and 64x8x8 values all exceed MAX_FLAT, so
    # every block gives 3 statistics per channel
    (resnet20_gn, (3, 32, 32), {"stem": 48, **{f"block{i}": 48 for i in (1, 2, 3)},
                                **{f"block{i}": 96 for i in (4, 5, 6)},
                                **{f"block{i}": 192 for i in (7, 8, 9)}, "head": 10}),
])
def test_ir_features_shapes_and_chunking(factory, shape, widths) -> None:
    torch.manual_seed(0)
    model = factory()
    model.train()
    x = torch.randn(5, *shape)
    whole = ir_features(model, x)
    chunked = ir_features(model, x, batch=2)
    assert {k: v.shape for k, v in whole.items()} == {k: (5, w) for k, w in widths.items()}
    assert all(v.dtype == np.float32 for v in whole.values())
    for name in widths:
        np.testing.assert_allclose(whole[name], chunked[name], rtol=1e-4, atol=1e-5)
    assert model.training  # mode restored
    last = model.layer_names[-1]
    assert list(ir_features(model, x, layers=[last])) == [last]
    ordered = ir_features(model, x, sort_units=True)
    for name in widths:
        assert ordered[name].shape == whole[name].shape
        assert (np.diff(ordered[name][:, :widths[last]], axis=1) <= 0).all()


def test_balanced_xy_subsamples_the_larger_class() -> None:
    rng = np.random.default_rng(0)
    x, y = balanced_xy(np.ones((30, 2)), np.zeros((10, 2)), rng=rng)
    assert x.shape == (20, 2) and y.tolist() == [1] * 10 + [0] * 10
    members = np.arange(60.0).reshape(30, 2)
    x, y = balanced_xy(members, np.zeros((10, 2)), rng=rng, max_per_class=4)
    assert y.tolist() == [1] * 4 + [0] * 4
    assert len({tuple(r) for r in x[:4]}) == 4 and np.isin(x[:4], members).all()
    with pytest.raises(ValueError):
        balanced_xy(np.ones((3, 2)), np.zeros((0, 2)), rng=rng)


def _synthetic(shift: float, *, n: int, seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    members = {"a": rng.normal(shift, 1.0, size=(n, 8)), "b": rng.normal(0.0, 1.0, size=(n, 3))}
    nonmembers = {"a": rng.normal(0.0, 1.0, size=(n, 8)), "b": rng.normal(0.0, 1.0, size=(n, 3))}
    return members, nonmembers


@pytest.mark.parametrize("kind", ["mlp", "logreg"])
def test_attack_accuracy_extremes(kind: str) -> None:
    """Separable members -> ~1; the same distribution -> ~0.5 (on fresh labelled data)."""
    fit_m, fit_o = _synthetic(3.0, n=600, seed=1)
    eval_m, eval_o = _synthetic(3.0, n=600, seed=2)
    attacks = fit_layer_attacks(fit_m, fit_o, seed=0, kind=kind)
    acc = layer_accuracies(attacks, eval_m, eval_o)
    assert acc["a"] >= 0.97  # 8 dims shifted by 3 sigma
    assert abs(acc["b"] - 0.5) <= 0.06  # identical distributions
    err = attack_error_rate(attacks["a"], eval_m["a"], eval_o["a"])
    assert err == pytest.approx(1.0 - attack_accuracy(attacks["a"], eval_m["a"], eval_o["a"]))


def test_attack_is_deterministic_and_balanced_on_unequal_pools() -> None:
    m, o = _synthetic(1.0, n=400, seed=3)
    o = {k: v[:100] for k, v in o.items()}  # 400 members, 100 non-members
    a = fit_layer_attacks(m, o, seed=7)
    b = fit_layer_attacks(m, o, seed=7)
    assert layer_accuracies(a, m, o) == layer_accuracies(b, m, o)
    # balanced accuracy: always guessing "member" scores 0.5, not 0.8
    always = make_attack(kind="logreg", seed=0).fit(np.r_[m["b"][:2], o["b"][:2]], [1, 1, 0, 0])
    always.predict = lambda x: np.ones(len(x), dtype=np.int64)  # type: ignore[method-assign]
    assert attack_accuracy(always, m["b"], o["b"]) == 0.5


def test_unknown_attack_kind_is_a_user_error() -> None:
    with pytest.raises(UserInputError) as err:
        make_attack(kind="forest", seed=0)
    assert err.value.field == "attack"


def test_split_features_keeps_rows_aligned_across_layers() -> None:
    feats = {"a": np.arange(10)[:, None] * 1.0, "b": np.arange(10)[:, None] * 2.0}
    first, rest = split_features(feats, fraction=0.3, rng=np.random.default_rng(0))
    assert len(first["a"]) == 3 and len(rest["a"]) == 7
    np.testing.assert_array_equal(first["b"], 2 * first["a"])
    assert sorted(np.r_[first["a"], rest["a"]].ravel().tolist()) == list(range(10))
