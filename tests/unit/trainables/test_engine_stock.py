"""The engine on what stock networks do: every per-example norm and weighted sum equals
autograd on one example at a time (float64, to 1e-10) for attention with masks, recurrent
layers in every configuration, parameters of containers, frozen parameters and in-place
outputs; what it cannot follow is refused by name, and a chunked view recomputes the very
gradients it clipped when the forward draws randomness (dropout)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
from torch import nn

from dpsweep.trainables.engine.func import NotPerExample
from dpsweep.trainables.engine.grad_engine import ENGINE_PATH, GradEngine, MaterializedGrads
from dpsweep.trainables.models.networks import WrappedModel

N = 5


class _Attend(nn.Module):
    def __init__(self, *, batch_first: bool, weights: bool, masks: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 3)
        self.batch_first, self.weights, self.masks = batch_first, weights, masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h if self.batch_first else h.transpose(0, 1)
        length = x.shape[1]
        kwargs: dict[str, object] = {"need_weights": self.weights}
        if self.masks in ("bool", "both"):
            kwargs["attn_mask"] = torch.ones(length, length, dtype=torch.bool).triu(1)
        if self.masks in ("padding", "both"):
            kwargs["key_padding_mask"] = x == 0
        if self.masks == "float":
            kwargs["attn_mask"] = torch.linspace(-1, 1, length * length).view(length, length)
        out, _ = self.attn(h, h, h, **kwargs)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1))


class _Recur(nn.Module):
    def __init__(self, cell: type[nn.Module], *, given_state: bool, **kwargs: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.rnn = cell(6, 5, **kwargs)
        dirs = 2 if kwargs.get("bidirectional") else 1
        self.head = nn.Linear(5 * dirs, 3)
        self.given_state, self.batch_first = given_state, kwargs.get("batch_first", False)
        self.cell, self.layers, self.dirs = cell, kwargs.get("num_layers", 1), dirs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h if self.batch_first else h.transpose(0, 1)
        state = None
        if self.given_state:
            h0 = torch.full((self.layers * self.dirs, x.shape[0], 5), 0.1, dtype=h.dtype)
            state = (h0, h0 * 2) if self.cell is nn.LSTM else h0
        out, last = self.rnn(h, state)
        final = (last[0] if isinstance(last, tuple) else last)[-1]
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out[:, -1] + final.repeat(1, self.dirs)[:, :out.shape[-1]])


class _Container(nn.Module):
    """A root that owns parameters used twice, in a list, and once before the batch."""

    def __init__(self, *, early: bool = False) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 6))
        self.scale = nn.Parameter(torch.ones(6))
        self.embed = nn.Embedding(20, 6)
        self.head = nn.Linear(6, 3)
        self.early = early

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        token = self.token.expand(x.shape[0], -1, -1)
        h = torch.cat([token, h], dim=1) * self.scale
        if self.early:  # the parameter transformed on its own (sliced), then broadcast
            h = h + (self.scale[:4].repeat(2)[:6] * 2).tanh()
        return self.head(torch.relu_(h.mean(1) + self.scale))


def _wrap(net: nn.Module) -> WrappedModel:
    layers = {n: n for n, m in net.named_children() if next(m.parameters(), None) is not None}
    return WrappedModel(net.double(), layers=layers, num_classes=3)


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 20, (N, 7), generator=g)
    x[0, -2:] = 0  # padding at the end of one example
    return x, torch.randint(0, 3, (N,), generator=g)


def _reference(engine: GradEngine, x: torch.Tensor, y: torch.Tensor) -> MaterializedGrads:
    params = dict(engine.model.named_parameters())
    grads: dict[str, list[torch.Tensor]] = {k: [] for k in params}
    for i in range(x.shape[0]):
        loss = nn.functional.cross_entropy(engine.model(x[i:i + 1]), y[i:i + 1])
        got = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for k, g in zip(params, got, strict=True):
            grads[k].append(torch.zeros_like(params[k]) if g is None else g)
    return MaterializedGrads.from_grads({k: torch.stack(v) for k, v in grads.items()},
                                        layer_of=engine.layer_of, num_layers=engine.num_layers)


def _released(engine: GradEngine, view: object) -> torch.Tensor:
    """[N, L] float64 norm of each example's release alone, per layer (its one-hot sum)."""
    out = torch.zeros(N, engine.num_layers, dtype=torch.float64)
    for i in range(N):
        coef = torch.zeros(N, engine.num_layers, dtype=torch.float64)
        coef[i] = 1.0
        for n, v in view.weighted_sum(coef).items():
            out[i, engine.layer_of[n]] += float(v.double().square().sum())
    return out.sqrt()


def _agrees(build: Callable[[], nn.Module], *, chunk: int = 512) -> GradEngine:
    torch.manual_seed(0)
    model = _wrap(build())
    x, y = _tokens()
    engine = GradEngine(model, max_physical_batch=chunk)
    live = [True] * engine.num_layers
    view = engine.compute(x, y, live=live)
    ref = _reference(engine, x, y)
    torch.testing.assert_close(view.norms, ref.norms, rtol=1e-10, atol=1e-14)
    coef = torch.rand(N, engine.num_layers, dtype=torch.float64)
    want = ref.weighted_sum(coef)
    for name, got in view.weighted_sum(coef).items():
        torch.testing.assert_close(got, want[name], rtol=1e-10, atol=1e-13)
    return engine


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(("weights", "masks"), [(False, "none"), (False, "both"),
                                                (True, "bool"), (False, "float"),
                                                (True, "padding")])
def test_self_attention_takes_linear_rules_with_every_mask(batch_first: bool, weights: bool,
                                                           masks: str) -> None:
    engine = _agrees(lambda: _Attend(batch_first=batch_first, weights=weights, masks=masks),
                     chunk=2)
    assert engine.path == ENGINE_PATH


@pytest.mark.parametrize(("cell", "kwargs"), [
    (nn.LSTM, {"num_layers": 2, "batch_first": True}),
    (nn.LSTM, {"bidirectional": True}),
    (nn.GRU, {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    (nn.GRU, {"bias": False}),
    (nn.RNN, {"nonlinearity": "relu", "num_layers": 2}),
    (nn.RNN, {"bidirectional": True, "batch_first": True}),
])
@pytest.mark.parametrize("given_state", [False, True])
def test_recurrent_layers_take_linear_rules(cell: type[nn.Module], kwargs: dict[str, object],
                                            given_state: bool) -> None:
    engine = _agrees(lambda: _Recur(cell, given_state=given_state, **kwargs), chunk=3)
    assert engine.path == ENGINE_PATH


def test_a_containers_parameters_go_by_their_uses() -> None:
    """Uses directly on activations, in a list, and through ops on the parameter alone
    (followed to where it meets the batch)."""
    for early in (False, True):
        engine = _agrees(lambda early=early: _Container(early=early), chunk=2)
        assert engine.path == ENGINE_PATH
        assert next(type(u).__name__ for u in engine._units) == "ParamUses"


def test_frozen_parameters_are_left_out_of_every_norm() -> None:
    def frozen() -> nn.Module:
        net = _Recur(nn.LSTM, given_state=False, batch_first=True)
        net.embed.requires_grad_(False)
        net.rnn.bias_hh_l0.requires_grad_(False)
        return net

    engine = _agrees(frozen)
    assert engine.layer_names == ["rnn", "head"]
    assert "net.rnn.bias_hh_l0" not in engine.layer_of


class _ChangesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(1)
        out = self.fc(h)
        h.mul_(2)  # fc's input, changed after fc ran
        return self.head(out + h)


def test_an_input_changed_in_place_after_its_module_ran_is_refused_by_name() -> None:
    model = _wrap(_ChangesInput())
    x, y = _tokens()
    with pytest.raises(NotPerExample, match=r"the input of net\.fc is changed in place"):
        GradEngine(model).compute(x, y, live=[True] * 3)


def test_cross_attention_is_refused_by_name() -> None:
    class Cross(_Attend):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            out, _ = self.attn(h, h * 2, h, need_weights=False)
            return self.head(out.mean(1))

    model = _wrap(Cross(batch_first=True, weights=False, masks="none"))
    x, y = _tokens()
    with pytest.raises(NotPerExample, match=r"net\.attn .*cross-attention"):
        GradEngine(model).compute(x, y, live=[True] * 3)


def test_a_chunked_view_releases_the_gradients_it_clipped_under_dropout() -> None:
    """Each example's weighted sum alone has exactly the norm the view reported, also for
    chunks recomputed after the first (the dropout masks are drawn again identically)."""
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(
        embed=nn.Embedding(20, 8),
        enc=nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5,
                                                             batch_first=True), 1,
                                  enable_nested_tensor=False),
        pool=nn.Flatten(), head=nn.Linear(56, 3)))
    model = _wrap(net)
    model.train()
    x, y = _tokens()
    engine = GradEngine(model, max_physical_batch=2)
    view = engine.compute(x, y, live=[True] * engine.num_layers)
    torch.testing.assert_close(_released(engine, view), view.norms, rtol=1e-9, atol=0)


class _Bag(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 6, mode=mode, padding_idx=0)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(x))


@pytest.mark.parametrize(("mode", "unit"), [("mean", "EmbeddingBagHandler"),
                                            ("sum", "EmbeddingBagHandler"),
                                            ("max", "OwnerFallback")])
def test_embedding_bags_take_their_rule_or_the_exact_fallback(mode: str, unit: str) -> None:
    engine = _agrees(lambda: _Bag(mode), chunk=2)
    assert next(type(u).__name__ for u in engine._units) == unit


def test_an_embedding_bag_that_rewrites_its_weight_is_refused() -> None:
    from dpsweep.core.errors import UserInputError
    from dpsweep.trainables.models.validator import wrap_checked

    net = _Bag("mean")
    net.bag.max_norm = 1.0
    with pytest.raises(UserInputError, match="build EmbeddingBag 'bag' without max_norm"):
        wrap_checked(net, layers=(), sample=_tokens()[0][:2], num_classes=3)


def test_a_gradient_that_cancels_is_released_as_normed() -> None:
    """A transformer whose embedding is scaled by 1e15: in an attention projection the
    per-example terms a_t b_t^T cancel to ~1e-8 of their size, below what a float32 ghost norm
    resolves (it reads 0 where the gradient is 7e19). Such examples are materialised, so each
    example's release, alone, has exactly the norm the view reports, layer by layer."""
    from tests import stock_nets

    for seed in range(4):
        torch.manual_seed(0)
        model = WrappedModel(stock_nets.encoder((7,), 3), num_classes=3, layers={
            n: n for n in ("embed", "encoder", "head")})
        with torch.no_grad():
            model.net.embed.weight.mul_(1e15)
        x, y = _tokens(seed)
        engine = GradEngine(model)
        torch.manual_seed(seed)
        view = engine.compute(x, y, live=[True] * engine.num_layers)
        released = _released(engine, view)
        assert bool((released <= view.norms * (1 + 1e-5) + 1e-30).all()), (seed, released)
