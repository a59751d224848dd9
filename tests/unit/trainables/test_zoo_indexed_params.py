"""Parameters read outside their own module (issue 45: torchvision's Swin v1).

Swin v1's window attention never calls its ``qkv`` and ``proj`` Linear children: it hands their
weights to ``F.linear`` on rows that fold the batch with the windows, and indexes its own
``relative_position_bias_table`` by a buffer. Those parameters used to get no per-example
gradient (the check refused the model as one that "mixes examples"); the engine now finds every
parameter read outside its module and differentiates the reading module exactly
(``trainables/engine/reads.py``). Every number here is compared with autograd on one example
at a time: the norms and sums in float64 to 1e-10, and one DP-SGD step by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.swin_transformer import SwinTransformer

from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Schedule
from dpsweep.trainables.dp.randomness import Randomness
from dpsweep.trainables.dp.step import NORM_EPS
from dpsweep.trainables.engine import reads
from dpsweep.trainables.engine.func import OwnerFallback
from dpsweep.trainables.engine.grad_engine import (
    BLOCK_EXACT_PATH,
    WHOLE_EXACT_PATH,
    GradEngine,
    MaterializedGrads,
)
from dpsweep.trainables.methods.dpsgd import DPSGD
from dpsweep.trainables.models.networks import WrappedModel
from dpsweep.trainables.models.validator import sample_batch, wrap_checked
from tests.contract.conformance import Workload, make_method

N = 3
IMAGE = sample_batch(input_shape=(1, 8, 8), tokens=False, rows=4)
SWIN_INPUT = (3, 16, 16)


def _swin() -> SwinTransformer:
    """torchvision's Swin v1 at its smallest: two stages of one block, 2x2 windows, on 16x16
    images (4x4 patches of 4x4 pixels); no stochastic depth, so that a training-mode forward
    is one function of the parameters, as the references need."""
    torch.manual_seed(0)
    return SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[2, 2],
                           window_size=[2, 2], stochastic_depth_prob=0.0, num_classes=10)


class _Window(nn.Module):
    """Swin v1's pattern at toy size: a Linear child read (never called) on rows that fold the
    batch with two windows, and a table of its own indexed by a buffer."""

    def __init__(self, width: int, tokens: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, width)
        self.table = nn.Parameter(torch.randn(tokens + 1, width) / 4)
        self.register_buffer("index", torch.arange(tokens).flip(0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        rows = h.reshape(b * 2, t // 2, c)
        out = F.linear(rows, self.qkv.weight, self.qkv.bias) + self.table[self.index]
        return out.reshape(b, t, c)


class _WindowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 32)
        self.attn = _Window(4, 4)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1)).view(-1, 8, 4)
        return self.head(torch.tanh(self.attn(h)).flatten(1))


class _RootReads(nn.Module):
    """The network's own forward reads its head's weight a second time."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh())
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(h) + F.linear(h, self.head.weight).tanh()


class _MixesGradients(nn.Module):
    """Each example's output is its own, its gradient is not: a batch mean of zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out + (out - out.detach()).mean(0, keepdim=True)


def _wrap(net: nn.Module) -> WrappedModel:
    layers = {n: n for n, m in net.named_children() if next(m.parameters(), None) is not None}
    return WrappedModel(net.double(), layers=layers, num_classes=10)


def _reference(engine: GradEngine, x: torch.Tensor, y: torch.Tensor) -> MaterializedGrads:
    """Per-example gradients by autograd on one example at a time."""
    params = dict(engine.model.named_parameters())
    grads: dict[str, list[torch.Tensor]] = {k: [] for k in params}
    for i in range(x.shape[0]):
        loss = F.cross_entropy(engine.model(x[i:i + 1]), y[i:i + 1])
        for k, g in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
            grads[k].append(g)
    return MaterializedGrads.from_grads({k: torch.stack(v) for k, v in grads.items()},
                                        layer_of=engine.layer_of, num_layers=engine.num_layers)


def _batch(shape: tuple[int, ...], n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, *shape, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (n,), generator=g))


def _agrees(model: WrappedModel, x: torch.Tensor, y: torch.Tensor) -> GradEngine:
    """The engine's norms and weighted sums are autograd's, every parameter included."""
    engine = GradEngine(model)
    view = engine.compute(x, y, live=[True] * engine.num_layers)
    ref = _reference(engine, x, y)
    assert bool((ref.norms > 0).all())
    torch.testing.assert_close(view.norms, ref.norms, rtol=1e-10, atol=0)
    coef = torch.rand(x.shape[0], engine.num_layers, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(2))
    want = ref.weighted_sum(coef)
    got = view.weighted_sum(coef)
    assert set(got) == set(want)
    for name, value in got.items():
        assert float(want[name].abs().max()) > 0, name
        torch.testing.assert_close(value, want[name], rtol=1e-10, atol=1e-14, msg=name)
    return engine


def test_swin_v1_takes_its_window_attention_as_one_exact_block() -> None:
    engine = _agrees(_wrap(_swin()), *_batch(SWIN_INPUT))
    fallbacks = {u.qualname: u for u in engine._units if isinstance(u, OwnerFallback)}
    assert sorted(fallbacks) == ["net.features.1.0.attn", "net.features.3.0.attn"]
    assert sorted(fallbacks["net.features.1.0.attn"].local) == [
        "proj.bias", "proj.weight", "qkv.bias", "qkv.weight", "relative_position_bias_table"]
    assert not any(u.qualname.startswith("net.features.1.0.attn.") for u in engine._units)
    assert engine.path == BLOCK_EXACT_PATH


def test_both_exact_paths_train_through_stochastic_depth() -> None:
    """In training mode Swin drops each example's residual branch at random (stochastic depth,
    torchvision's "row" mode): both exact paths draw per example, so the steps run (the
    whole-model path raised under vmap's default randomness), every norm finite and positive,
    and the engine's weighted sum is the sum of what its norms measured (the block path's
    fallbacks see the masks the forward drew, through their kept output gradients)."""
    torch.manual_seed(0)
    net = SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[2, 2],
                          window_size=[2, 2], stochastic_depth_prob=0.5, num_classes=10)
    model = _wrap(net).train()
    x, y = _batch(SWIN_INPUT)
    for strategy in ("auto", "vmap"):
        engine = GradEngine(model, strategy=strategy)
        view = engine.compute(x, y, live=[True] * engine.num_layers)
        assert bool(torch.isfinite(view.norms).all()) and bool((view.norms > 0).all())
        sums = view.weighted_sum(torch.ones(N, engine.num_layers, dtype=torch.float64))
        assert set(sums) == set(engine.layer_of)


def test_a_parameter_read_by_its_parent_goes_with_the_parent() -> None:
    engine = _agrees(_wrap(_WindowNet()), *_batch((1, 8, 8)))
    kinds = {u.qualname: type(u).__name__ for u in engine._units}
    assert kinds == {"net.stem": "LinearHandler", "net.attn": "OwnerFallback",
                     "net.head": "LinearHandler"}


def test_a_read_by_the_network_itself_takes_the_whole_model_path() -> None:
    model = wrap_checked(_RootReads(), layers=(), sample=IMAGE, num_classes=10)
    assert model.per_example_path == WHOLE_EXACT_PATH


def test_swin_v1_passes_the_check_and_one_dp_sgd_step_clips_autograds_gradients() -> None:
    """The real check, then one DP-SGD step in float64: each example's gradient by autograd
    alone, clipped at C (over its norm plus NORM_EPS; C lies between the examples' norms, so
    some are clipped and some not), summed, plus sigma C z with the step's own draws, over the
    expected batch size."""
    checked = wrap_checked(_swin(), layers=(), sample=sample_batch(
        input_shape=SWIN_INPUT, tokens=False), num_classes=10)
    assert checked.per_example_path == BLOCK_EXACT_PATH
    x, y = _batch(SWIN_INPUT, 4)
    sigma, lr, batch = 0.5, 0.1, 50.0
    probe = GradEngine(checked.double())
    ref = _reference(probe, x, y)
    flat = ref.norms.square().sum(1).sqrt()
    clip = float(flat.median())
    assert float(flat.min()) < clip < float(flat.max())
    w = Workload(model=lambda: checked, train=(x, y), public=(x, y), crafted=(x, y))
    step = make_method(DPSGD, params=DPSGD.validate_params({"lr": lr, "clip_norm": clip}),
                       schedule=Schedule.constant(noise_multiplier=sigma, steps=100),
                       dtype=torch.float64, workload=w, expected_batch_size=batch)
    replay = Randomness(kind="reproducible", device=torch.device("cpu"), seed=0)
    z = {n: replay.normal(p.shape, dtype=p.dtype) for n, p in step.model.named_parameters()}
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    factor = (clip / (flat + NORM_EPS)).clamp(max=1.0)
    step.step(x, y)
    assert step.engine.path == BLOCK_EXACT_PATH
    for n, p in step.model.named_parameters():
        clipped = (factor.view(-1, *[1] * (p.dim())) * ref.grads[n]).sum(0)
        expected = before[n] - lr * (clipped + sigma * clip * z[n]) / batch
        torch.testing.assert_close(p.detach(), expected, rtol=1e-9, atol=1e-12, msg=n)


def test_what_the_engine_misses_is_named_and_not_called_mixing(monkeypatch) -> None:
    """With the reads not followed (the engine before this fix), the check names the
    parameter and its module; only a model that does mix examples is told so."""
    monkeypatch.setattr(reads, "find_readers", lambda *args, **kwargs: {})
    with pytest.raises(UserInputError) as err:
        wrap_checked(_WindowNet(), layers=(), sample=IMAGE, num_classes=10)
    text = str(err.value)
    assert "\n" not in text and "mixes examples" not in text
    assert "parameter 'attn.qkv.weight' of module 'attn.qkv' (Linear)" in text
    assert "no example's gradient depends on another's" in text
    monkeypatch.undo()
    with pytest.raises(UserInputError) as err:
        wrap_checked(_MixesGradients(), layers=(), sample=IMAGE, num_classes=10)
    assert "layer 'body'" in str(err.value)
    assert "something in it mixes examples (parameter 'body.1." in str(err.value)
