"""The book-keeping engine gives exactly the vmap reference's per-layer norms and weighted sums.

Float64 everywhere the engine is compared with the reference (agreement to ~1e-12 relative),
float32 where it is compared with plain autograd (the summed gradient with unit coefficients).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.engine.grad_engine import GradEngine, MaterializedGrads, PerExampleView
from dpsweep.trainables.engine.modules import Conv2dHandler, Geometry, choose
from dpsweep.trainables.engine.passes import LOOSE
from dpsweep.trainables.models.networks import LayeredModel, build_model

NUM_CLASSES = 10
RTOL = 1e-9
ATOL = 1e-12


def _model(name: str, shape: tuple[int, int, int], *, seed: int = 0) -> LayeredModel:
    torch.manual_seed(seed)
    act = "relu" if name in ("resnet20_gn", "wrn16_4") else "tanh"
    return build_model(name=name, input_shape=shape, num_classes=NUM_CLASSES,
                       activation=act).double()


def _batch(shape: tuple[int, ...], n: int, *, seed: int = 1,
           classes: int = NUM_CLASSES) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, *shape, generator=g, dtype=torch.float64),
            torch.randint(0, classes, (n,), generator=g))


def _coef(n: int, layers: int, *, seed: int = 2) -> torch.Tensor:
    """Random coefficients in [-1, 2) with a zero row, a zero column and scattered zeros."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(n, layers, generator=g, dtype=torch.float64) * 3 - 1
    c[torch.rand(n, layers, generator=g) < 0.2] = 0.0
    c[0] = 0.0
    if layers > 1:
        c[:, 1] = 0.0
    return c


def _assert_matches(view: PerExampleView, ref: PerExampleView, coef: torch.Tensor) -> None:
    torch.testing.assert_close(view.norms, ref.norms, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(view.losses, ref.losses, rtol=RTOL, atol=ATOL)
    got, want = view.weighted_sum(coef), ref.weighted_sum(coef)
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=RTOL, atol=ATOL, msg=name)


def _check(model: LayeredModel, x: torch.Tensor, y: torch.Tensor, *, strategies: tuple[str, ...],
           live: list[bool] | None = None, max_physical_batch: int = 512) -> None:
    layers = len(model.layer_names)
    live = [True] * layers if live is None else live
    ref = GradEngine(model, strategy="vmap").compute(x, y, live=live)
    assert bool((ref.norms[:, [i for i, on in enumerate(live) if on]] > 0).all())
    coef = _coef(x.shape[0], layers)
    for strategy in strategies:
        engine = GradEngine(model, strategy=strategy, max_physical_batch=max_physical_batch)
        _assert_matches(engine.compute(x, y, live=live), ref, coef)


# ---- the repository's models -------------------------------------------------------------------
ALL = ("auto", "ghost", "materialize")
MODELS = [
    ("digits_cnn", (1, 8, 8), 5, ALL),
    ("cnn28", (1, 28, 28), 4, ALL),
    ("cnn5", (1, 28, 28), 3, ("auto",)),
    ("cnn5", (3, 32, 32), 3, ALL),
    ("resnet20_gn", (3, 32, 32), 3, ALL),
    ("resnet20_gn", (1, 28, 28), 2, ("auto",)),
    ("wrn16_4", (3, 32, 32), 2, ("auto", "materialize")),
]


@pytest.mark.parametrize(("name", "shape", "n", "strategies"), MODELS,
                         ids=[f"{m[0]}-{m[1][1]}" for m in MODELS])
def test_models_match_vmap(name: str, shape: tuple[int, int, int], n: int,
                           strategies: tuple[str, ...]) -> None:
    model = _model(name, shape)
    x, y = _batch(shape, n)
    _check(model, x, y, strategies=strategies)


def test_wrn_ghost_everywhere_small_input() -> None:
    model = _model("wrn16_4", (1, 28, 28))
    x, y = _batch((1, 28, 28), 2)
    _check(model, x, y, strategies=("ghost",))


def test_frozen_layers_get_no_gradient_and_zero_norm() -> None:
    model = _model("resnet20_gn", (3, 32, 32))
    x, y = _batch((3, 32, 32), 3)
    live = [False, True, False, False, True, True, False, False, False, True, False]
    _check(model, x, y, strategies=ALL, live=live)
    view = GradEngine(model).compute(x, y, live=live)
    frozen = [i for i, on in enumerate(live) if not on]
    assert bool((view.norms[:, frozen] == 0).all())
    owner = model.layer_of_parameter()
    summed = view.weighted_sum(torch.ones_like(view.norms))
    assert set(summed) == {n for n, i in owner.items() if live[i]}


def test_chunks_match_and_keep_only_the_last_chunk() -> None:
    model = _model("cnn5", (3, 32, 32))
    x, y = _batch((3, 32, 32), 5)
    _check(model, x, y, strategies=ALL, max_physical_batch=2)
    view = GradEngine(model, max_physical_batch=2).compute(x, y, live=[True] * 5)
    assert view._bounds == [(0, 2), (2, 4), (4, 5)]
    assert view._states[0] is None and view._states[1] is None and view._states[2] is not None
    coef = _coef(5, 5)
    first = view.weighted_sum(coef)
    again = view.weighted_sum(coef)  # recomputed chunks give the same sums every time
    for name, s in first.items():
        assert torch.equal(s, again[name])
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match="changed"):
        view.weighted_sum(coef)


def test_one_example_batch() -> None:
    model = _model("cnn28", (1, 28, 28))
    x, y = _batch((1, 28, 28), 1)
    _check(model, x, y, strategies=ALL)


def test_unit_coefficients_give_the_autograd_gradient_of_the_summed_loss() -> None:
    torch.manual_seed(0)
    model = build_model(name="resnet20_gn", input_shape=(3, 32, 32), num_classes=NUM_CLASSES,
                        activation="relu")
    x, y = _batch((3, 32, 32), 4)
    x = x.float()
    params = dict(model.named_parameters())
    want = torch.autograd.grad(F.cross_entropy(model(x), y, reduction="sum"),
                               list(params.values()))
    live = [True] * len(model.layer_names)
    exact = GradEngine(copy.deepcopy(model).double(), strategy="vmap").compute(
        x.double(), y, live=live).norms
    for strategy in ALL:
        view = GradEngine(model, strategy=strategy, max_physical_batch=3).compute(
            x, y, live=live)
        assert view.norms.dtype == torch.float64  # norms never underflow (scaled, float64)
        _assert_certified(view.norms, exact)
        got = view.weighted_sum(torch.ones_like(view.norms))
        assert set(got) == set(params)
        for (name, _), w in zip(params.items(), want, strict=True):
            torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=name)
    assert all(p.grad is None for p in model.parameters())  # the engine never fills .grad


#: How far above the float64 reference a certified norm of a real model may lie on the CPU:
#: an example whose certificate is looser than ``LOOSE`` is materialised and normed exactly
#: (over-clipping, never under).
GHOST_OVER = LOOSE - 1 + 1e-6
#: The float32 model's own gradients differ from the float64 model's by their rounding.
MODEL_RTOL = 1e-4


def _assert_certified(got: torch.Tensor, exact: torch.Tensor, *, rtol: float = MODEL_RTOL,
                      over: float = GHOST_OVER) -> None:
    """Certified norms: never below the reference (beyond the models' own rounding ``rtol``)
    and at most ``over`` above it."""
    assert bool((got >= exact * (1 - rtol)).all()), float((got / exact).nan_to_num(1).min())
    assert bool((got <= exact * (1 + over) + 1e-30).all()), float(
        (got / exact).nan_to_num(1).max())


def test_norms_of_known_gradients() -> None:
    """Synthetic gradients: layer norms are the known numbers, certified (at most the plain
    slack above them, never below); sums are the known numbers."""
    from dpsweep.trainables.engine.norms import plain_slack

    grads = {"a": torch.tensor([[3.0, 0.0], [0.0, 1.0]]),
             "b": torch.tensor([[4.0], [0.0]]),
             "c": torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]]])}
    view = MaterializedGrads.from_grads(grads, layer_of={"a": 0, "b": 0, "c": 1}, num_layers=2)
    known = torch.tensor([[5.0, 2.0 ** 0.5], [1.0, 8.0 ** 0.5]], dtype=torch.float64)
    _assert_certified(view.norms, known, rtol=0.0, over=plain_slack(2, torch.float32))
    assert plain_slack(2, torch.float32) < 1e-6
    summed = view.weighted_sum(torch.tensor([[0.5, 0.0], [2.0, 1.0]]))
    torch.testing.assert_close(summed["a"], torch.tensor([1.5, 2.0]))
    torch.testing.assert_close(summed["b"], torch.tensor([2.0]))
    torch.testing.assert_close(summed["c"], torch.tensor([[2.0, 2.0]]))
    with pytest.raises(ValueError, match="shape"):
        view.weighted_sum(torch.ones(2, 3))


# ---- module types, fallbacks, odd shapes --------------------------------------------------------
def _conv_variants() -> LayeredModel:
    """Stride, dilation, groups, no bias, GroupNorm, reflect padding, 'same' with an even kernel."""
    torch.manual_seed(3)
    return LayeredModel([
        ("c1", nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Tanh())),  # 5x5
        ("c2", nn.Sequential(nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2, bias=False),
                             nn.GroupNorm(3, 6), nn.Tanh())),
        ("c3", nn.Sequential(nn.Conv2d(6, 4, 3, padding=1, padding_mode="reflect"),
                             nn.Conv2d(4, 4, 2, padding="same"), nn.Tanh())),
        ("fc", nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 3))),
    ], num_classes=3).double()


def _sequence_model() -> LayeredModel:
    """Linear layers on [B, T, d] and LayerNorms (one without bias, one over two dims)."""
    torch.manual_seed(4)
    return LayeredModel([
        ("embed", nn.Sequential(nn.Unflatten(1, (3, 4)), nn.Linear(4, 5), nn.LayerNorm(5),
                                nn.Tanh())),
        ("mix", nn.Sequential(nn.Linear(5, 5, bias=False), nn.LayerNorm((3, 5), bias=False),
                              nn.Tanh())),
        ("out", nn.Sequential(nn.Flatten(), nn.Linear(15, 3))),
    ], num_classes=3).double()


class _Twice(nn.Module):
    """One Linear applied twice (shared weights)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _fallback_model() -> LayeredModel:
    """A PReLU (no algebra in the engine) makes its block fall back; a shared Linear."""
    torch.manual_seed(5)
    return LayeredModel([
        ("fc1", nn.Sequential(nn.Linear(6, 8), nn.Tanh())),
        ("prelu", nn.Sequential(nn.Linear(8, 8), nn.PReLU(8))),
        ("twice", _Twice(8)),
        ("out", nn.Linear(8, 3)),
    ], num_classes=3).double()


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("chunk", [512, 2])
def test_conv_variants(chunk: int) -> None:
    x, y = _batch((2, 9, 9), 5, classes=3)
    _check(_conv_variants(), x, y, strategies=ALL, max_physical_batch=chunk)


@pytest.mark.parametrize(("kwargs", "side"), [
    ({"kernel_size": 3, "padding": 1}, 6),
    ({"kernel_size": 5, "stride": 2, "padding": 2}, 9),
    ({"kernel_size": 3, "dilation": 2, "padding": 3, "groups": 2}, 7),
    ({"kernel_size": (2, 3), "stride": (1, 2), "padding": (0, 1)}, 6),
])
def test_shifted_input_gram_equals_the_patch_gram(kwargs: dict, side: int) -> None:
    """The input Gram from shifted position Grams is the Gram of the unfolded patches."""
    torch.manual_seed(6)
    conv = nn.Conv2d(4, 6, **kwargs).double()
    handler = Conv2dHandler(conv, qualname="conv", layer=0)
    a = torch.randn(3, 4, side, side, dtype=torch.float64)
    shifted = handler._input_gram(a, shifted=True)
    patches = handler._input_gram(a, shifted=False)
    assert shifted.shape == patches.shape == (3, conv.groups, *[conv(a)[0, 0].numel()] * 2)
    torch.testing.assert_close(shifted, patches, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("chunk", [512, 2])
def test_sequence_linear_and_layernorm(chunk: int) -> None:
    x, y = _batch((12,), 5, classes=3)
    _check(_sequence_model(), x, y, strategies=ALL, max_physical_batch=chunk)


@pytest.mark.parametrize("chunk", [512, 2])
def test_fallback_block_and_shared_weights(chunk: int) -> None:
    model = _fallback_model()
    x, y = _batch((6,), 5, classes=3)
    _check(model, x, y, strategies=ALL, max_physical_batch=chunk)
    _check(model, x, y, strategies=ALL, live=[False, True, True, False],
           max_physical_batch=chunk)
    norms = {p.layer: p.norm for p in GradEngine(model).plan(x)}
    assert norms["prelu"] == "vmap"


def test_requires_grad_flags_are_restored() -> None:
    model = _model("digits_cnn", (1, 8, 8))
    model.blocks["fc2"][0].bias.requires_grad_(False)
    x, y = _batch((1, 8, 8), 3)
    GradEngine(model).compute(x, y, live=[True, False, True, True]).weighted_sum(
        torch.ones(3, 4, dtype=torch.float64))
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert flags.pop("blocks.fc2.0.bias") is False
    assert all(flags.values())


def test_empty_batch_and_no_live_layer() -> None:
    model = _model("digits_cnn", (1, 8, 8))
    x, y = _batch((1, 8, 8), 3)
    empty = GradEngine(model).compute(x[:0], y[:0], live=[True] * 4)
    assert empty.norms.shape == (0, 4) and empty.losses.shape == (0,)
    sums = empty.weighted_sum(torch.zeros(0, 4, dtype=torch.float64))
    assert set(sums) == {n for n, _ in model.named_parameters()}
    assert all(bool((s == 0).all()) for s in sums.values())
    frozen = GradEngine(model).compute(x, y, live=[False] * 4)
    assert bool((frozen.norms == 0).all()) and bool((frozen.losses > 0).all())
    assert frozen.weighted_sum(torch.ones(3, 4, dtype=torch.float64)) == {}


# ---- the cost model ----------------------------------------------------------------------------
def test_cost_model_choices() -> None:
    # Linear on a flat input: ghost norm is free (T = 1)
    assert choose(Geometry(positions=1, fan_in=512, fan_out=32), strategy="auto") == (
        "ghost", False)
    # a wide 32x32 conv: materialise, and the per-example grads are small enough to keep
    assert choose(Geometry(positions=1024, fan_in=576, fan_out=64), strategy="auto") == (
        "materialize", True)
    # WRN's 16x16 stage with unfolded patches: T^2 (d + p) + Tpd > 3 Tpd, materialise, and
    # d > 2T drops the per-example grads; from shifted position Grams (K = 9 taps, 18x18
    # padded input) the input Gram costs 128 * 324^2 + 9 * 256^2 < d T^2: ghost
    assert choose(Geometry(positions=256, fan_in=1152, fan_out=128), strategy="auto") == (
        "materialize", False)
    wide = Geometry(positions=256, fan_in=1152, fan_out=128, taps=9, padded_positions=324)
    assert wide.shifted_gram and wide.input_gram_cost() == 128 * 324 ** 2 + 9 * 256 ** 2
    assert choose(wide, strategy="auto") == ("ghost", False)
    # 8x8 stage: ghost
    assert choose(Geometry(positions=64, fan_in=2304, fan_out=256), strategy="auto") == (
        "ghost", False)
    assert choose(Geometry(positions=64, fan_in=2304, fan_out=256), strategy="materialize") == (
        "materialize", False)
    plan = GradEngine(_model("cnn28", (1, 28, 28))).plan(torch.zeros(1, 1, 28, 28,
                                                                     dtype=torch.float64))
    assert [(p.layer, p.norm, p.keep) for p in plan] == [
        ("conv1", "materialize", True), ("conv2", "ghost", False), ("fc1", "ghost", False),
        ("fc2", "ghost", False)]
    assert [p.geometry.positions for p in plan] == [196, 25, 1, 1]


def test_bad_arguments_are_user_errors() -> None:
    model = _model("digits_cnn", (1, 8, 8))
    with pytest.raises(UserInputError, match="strategy"):
        GradEngine(model, strategy="fast")
    with pytest.raises(UserInputError, match="max_physical_batch"):
        GradEngine(model, max_physical_batch=0)
    x, y = _batch((1, 8, 8), 2)
    with pytest.raises(UserInputError, match="live"):
        GradEngine(model).compute(x, y, live=[True] * 3)
    view = GradEngine(model).compute(x, y, live=[True] * 4)
    with pytest.raises(ValueError, match="shape"):
        view.weighted_sum(torch.ones(2, 3, dtype=torch.float64))


def test_new_models_keep_layer_irs() -> None:
    for name, layers in (("resnet20_gn", ["stem", *[f"block{i}" for i in range(1, 10)], "head"]),
                         ("wrn16_4", ["stem", *[f"block{i}" for i in range(1, 7)], "head"])):
        model = _model(name, (3, 32, 32))
        assert model.layer_names == layers
        x, _ = _batch((3, 32, 32), 2)
        logits, irs = model.forward_with_irs(x)
        assert list(irs) == layers and torch.equal(irs["head"], logits)
        assert logits.shape == (2, NUM_CLASSES)
    sizes = {n: sum(p.numel() for p in _model(n, (3, 32, 32)).parameters())
             for n in ("resnet20_gn", "wrn16_4")}
    assert sizes == {"resnet20_gn": 269_722, "wrn16_4": 2_748_890}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("entry", [1e-3, 1e-23, 1e-41, 1e15])
def test_norms_do_not_underflow_or_overflow(dtype: torch.dtype, entry: float) -> None:
    """Blocks of n equal entries e have norm e sqrt(n), also where e^2 is subnormal or zero in
    float32 (1e-23; 1e-41 is itself subnormal there); squares of 1e30 (float32) would overflow
    the dtype, their scaled float64 sum does not; a non-finite entry gives an infinite norm."""
    from dpsweep.trainables.engine.norms import scaled_sq_norms

    n = 160
    value = torch.tensor(entry, dtype=dtype)  # as the dtype holds it
    g = torch.full((2, n), float(value), dtype=dtype)
    g[1] = 0.0
    sq = scaled_sq_norms(g)
    assert sq.dtype == torch.float64
    assert math.sqrt(float(sq[0])) == pytest.approx(float(value) * math.sqrt(n), rel=1e-6)
    assert float(sq[1]) == 0.0
    huge = torch.full((1, n), 1e30 if dtype == torch.float32 else 1e150, dtype=dtype)
    assert math.isfinite(float(scaled_sq_norms(huge)[0]))
    assert float(scaled_sq_norms(torch.tensor([[1.0, math.inf]], dtype=dtype))[0]) == math.inf
    assert float(scaled_sq_norms(torch.tensor([[1.0, math.nan]], dtype=dtype))[0]) == math.inf


@pytest.mark.parametrize("length", [3_000_001, 9_000_000])
def test_norms_and_sums_of_long_rows_keep_float64_accuracy(length: int) -> None:
    """A float32 reduction over a whole row loses precision with its length (a 9M-entry
    ``vector_norm`` came out 3e-4 low: an example clipped by it overshoots C by as much).
    The engine's certified norms of float32 rows lie within 1e-6 above float64 (2e-6 on the
    square) and its Gram sums match it to 1e-7, at layer sizes of a ResNet-18 (a deliberately
    naive float32 norm misses by more than 1e-6)."""
    from dpsweep.trainables.engine.norms import row_sums, scaled_sq_norms

    g = torch.randn(2, length, generator=torch.Generator().manual_seed(3))
    exact = g.double().square().sum(dim=1)
    _assert_certified(scaled_sq_norms(g), exact, rtol=0.0, over=2e-6)
    torch.testing.assert_close(row_sums(g.abs()), g.double().abs().sum(dim=1), rtol=1e-7,
                               atol=0)
    naive = torch.linalg.vector_norm(g, dim=1).double().square()
    assert float(((naive - exact) / exact).abs().max()) > 1e-6  # the check has teeth here


def test_engine_norms_of_tiny_gradients_match_float64() -> None:
    """The real engine on digits_cnn whose last layer is scaled by 1e-22: every earlier layer's
    per-example gradient has entries whose float32 squares are subnormal. Its float32 norms
    are certified against the float64 engine's (same weights)."""
    torch.manual_seed(0)
    model = build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=NUM_CLASSES)
    with torch.no_grad():
        for p in model.blocks["fc2"].parameters():
            p.mul_(1e-22)
    x, y = _batch((1, 8, 8), 6)
    live = [True] * len(model.layer_names)
    exact = GradEngine(copy.deepcopy(model).double(), strategy="vmap").compute(
        x.double(), y, live=live).norms
    assert float(exact[:, :3].max()) < 1e-18  # the regime where squares underflow in float32
    for strategy in ALL:
        got = GradEngine(model, strategy=strategy).compute(x.float(), y, live=live).norms
        _assert_certified(got, exact)


def test_full_precision_switches_reduced_precision_off_on_an_accelerator_only() -> None:
    """The certificates assume float32's roundoff, so TF32 and reduced-precision reductions
    are off around the norms and sums on an accelerator, and the user's settings come back
    after; on the CPU nothing is touched."""
    from dpsweep.trainables.engine.norms import full_precision

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = True
        with full_precision(torch.device("cpu")):
            assert matmul.allow_tf32 and cudnn.allow_tf32
        with full_precision(torch.device("cuda")):
            assert not matmul.allow_tf32 and not cudnn.allow_tf32
            assert not matmul.allow_fp16_reduced_precision_reduction
        assert matmul.allow_tf32 and cudnn.allow_tf32
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def test_a_ghost_certificate_bounds_cancelling_terms_that_float32_misses() -> None:
    """Two rank-one terms that cancel to 1e-4 of their size: the float32 ghost estimate may
    come out below the float64 norm, the certified one never does, for any of 200 draws."""
    from dpsweep.trainables.engine.modules import LinearHandler

    handler = LinearHandler(nn.Linear(64, 32), qualname="fc", layer=0)
    gen = torch.Generator().manual_seed(0)
    u, v = torch.randn(200, 64, generator=gen), torch.randn(200, 64, generator=gen)
    w = torch.randn(200, 32, generator=gen)
    a = torch.stack([u, u + 1e-4 * v], 1) * 30
    b = torch.stack([w, -w], 1)
    geometry = handler.geometry(a, b)
    sq, terms = handler.weight_ghost_sq(a, b)
    assert terms is not None
    certified = handler.certified(sq, terms, geometry=geometry, ghost=True, dtype=a.dtype)
    exact = torch.bmm(b.double().transpose(1, 2), a.double()).square().sum((1, 2))
    assert bool((sq < exact).any())  # the estimate alone is not a bound here
    assert bool((certified >= exact).all())
