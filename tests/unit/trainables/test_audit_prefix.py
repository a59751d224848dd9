"""A frozen prefix shared by the target and its references (trainables/audit/prefix.py): the
same per-layer signals as computing the prefix per model, never shared where weights differ
or the forward reads past the prefix, references starting from (and keeping) the target's
frozen backbone, and the stored outputs of their training examples training the same model."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dpsweep.core.trial import REPRODUCIBLE
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import match_budget, plan_trial
from dpsweep.trainables.audit import prefix as prefix_module
from dpsweep.trainables.audit.cache import reference_key
from dpsweep.trainables.audit.layer_attack import ir_features
from dpsweep.trainables.audit.prefix import (
    FrozenStart,
    PrefixTable,
    SharedPrefix,
    find_prefix,
    prefix_outputs,
    share_prefix,
    start_of,
    training_start,
    with_start,
    without_savings,
)
from dpsweep.trainables.audit.probes import ProbeSignals, probe_set_of
from dpsweep.trainables.audit.references import (
    Budget,
    NonPrivateRecipe,
    collect_signals,
    dp_trainer,
    nonprivate_trainer,
    plan_references,
    reference_data,
    reference_seed,
)
from dpsweep.trainables.audit.signals import per_example_signals
from dpsweep.trainables.data.splits import DataSplits, SplitSizes, load_splits
from dpsweep.trainables.models.assemble import build_network
from dpsweep.trainables.models.networks import LayeredModel, digits_cnn
from dpsweep.trainables.models.source import ModelSource
from dpsweep.trainables.models.validator import wrap_checked
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = SplitSizes(train=200, validation=100, holdout=200, test=97, shadow=400)
RECIPE = NonPrivateRecipe(epochs=3, lr=3e-3, batch_size=32)
#: Signals read from a float32 prefix cast to float64 differ from a float64 prefix by float32
#: rounding of the prefix's output, carried through the suffix.
RTOL = 1e-5
ATOL = 1e-6
#: A frozen backbone (random, or read from a weights file) and a trainable head.
PRETRAINED = ModelSource(factory="stock_nets:pretrained",
                         code_dir=str(Path(__file__).resolve().parents[2]))


@pytest.fixture(scope="module")
def data() -> DataSplits:
    return load_splits(dataset="digits", seed=0, sizes=SIZES)


def frozen_cnn(seed: int, *, frozen: tuple[str, ...] = ("conv1", "conv2")) -> LayeredModel:
    """digits_cnn with its first layers frozen (a built-in model: blocks run in sequence)."""
    torch.manual_seed(seed)
    model = digits_cnn()
    for name in frozen:
        model.blocks[name].requires_grad_(False)
    return model.eval()


class Backboned(nn.Module):
    """A user's network: a frozen stem and body with an in-place activation between them, a
    trainable head; ``skip`` also adds the stem's output to the head's input (a long skip)."""

    def __init__(self, *, skip: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8))
        self.act = nn.ReLU(inplace=True)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Dropout(dropout),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(32, 10)
        self.skip = skip
        self.stem.requires_grad_(False)
        self.body.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.act(self.stem(x))
        h = self.body(stem)
        if self.skip:
            h = h + stem.mean(dim=(2, 3)).repeat(1, 4)
        return self.head(h)


def wrapped(seed: int, data: DataSplits, **kwargs: object) -> LayeredModel:
    torch.manual_seed(seed)
    return wrap_checked(Backboned(**kwargs), layers=(), sample=data.shadow.x[:2],
                        num_classes=10).eval()


def same_backbone(model: LayeredModel, like: LayeredModel) -> LayeredModel:
    """``model`` with ``like``'s frozen parameters (what a reference starts from)."""
    start = FrozenStart.of(like)
    assert start is not None
    start.apply(model)
    return model


def assert_signals_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=RTOL, atol=ATOL, err_msg=name)


def _xy(data: DataSplits) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cat([data.holdout.x[:150], data.shadow.x[:150]]),
            torch.cat([data.holdout.y[:150], data.shadow.y[:150]]))


@pytest.mark.parametrize("kind", ["built-in", "user"])
def test_sharing_gives_the_per_layer_signals_of_the_whole_model(data: DataSplits,
                                                                kind: str) -> None:
    target = frozen_cnn(1) if kind == "built-in" else wrapped(1, data)
    other = same_backbone(frozen_cnn(2) if kind == "built-in" else wrapped(2, data), target)
    x, y = _xy(data)
    probes = ProbeSignals(probe_set=probe_set_of(data.validation, seed=0), num_classes=10)
    shared = share_prefix(target, x, features=probes.features)
    assert shared is not None and shared.prefix.train_exact
    assert shared.prefix.layers == (("conv1", "conv2") if kind == "built-in"
                                    else ("stem", "body"))
    for model in (target, other):
        assert shared.prefix.covers(model)
        own = per_example_signals(model=model, x=x, y=y)
        assert_signals_close(own, per_example_signals(model=model, x=x, y=y, shared=shared))
        fed = probes.shared(model, x, y, prefix=shared)
        # the fed forward's prefix outputs are placeholders: it keeps no features for others
        kept = ir_features(model, x)
        with without_savings():
            fresh = ir_features(model, x)
        for name, f in fresh.items():
            np.testing.assert_array_equal(kept[name], f, err_msg=name)
        whole = probes(model, x, y)
        assert_signals_close(whole, fed)
        for layer in shared.prefix.layers:  # fitted once, the same in every model
            assert np.array_equal(fed[f"probe_loss:{layer}"], whole[f"probe_loss:{layer}"])


def test_the_suffix_alone_runs_on_stored_rows_only(data: DataSplits) -> None:
    target = wrapped(1, data)
    x, _ = _xy(data)
    prefix = find_prefix(target, x[:8])
    assert prefix is not None and prefix.compact
    table = PrefixTable.compute(target, prefix, x[:20])
    assert table is not None
    shared = SharedPrefix(prefix=prefix, table=table)
    calls: list[int] = []
    hook = target.net.stem[0].register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad(), shared.feeding(target):
        stored = target(x[:20])
        unknown = target(x[100:120])  # rows not in the table: the whole model runs
    hook.remove()
    assert calls == [1]
    with torch.no_grad():
        assert torch.equal(stored, target(x[:20]))
        assert torch.equal(unknown, target(x[100:120]))
    assert "forward" not in vars(target.blocks["stem"])  # removed on leaving
    float64 = copy.deepcopy(target).double()
    assert table.rows(x[:20].double()) is not None  # a float64 copy of a row is the row
    with torch.no_grad(), shared.feeding(float64):
        torch.testing.assert_close(float64(x[:20].double()), stored.double(), rtol=RTOL,
                                   atol=ATOL)


def test_no_prefix_is_shared_where_weights_differ_or_the_forward_reads_past_it(
        data: DataSplits) -> None:
    x, _ = _xy(data)
    target = wrapped(1, data)
    shared = share_prefix(target, x)
    assert shared is not None
    stranger = wrapped(2, data)  # its own backbone
    assert not shared.prefix.covers(stranger)
    nudged = same_backbone(wrapped(2, data), target)
    with torch.no_grad():
        nudged.net.body[0].weight[0, 0, 0, 0] += 1e-6
    assert not shared.prefix.covers(nudged)
    trainable = same_backbone(wrapped(2, data), target)
    trainable.net.body.requires_grad_(True)  # the same weights, but the body trains
    assert not shared.prefix.covers(trainable)
    assert find_prefix(wrapped(1, data, skip=True), x[:8]) is None
    assert find_prefix(frozen_cnn(1, frozen=()), x[:8]) is None
    assert find_prefix(frozen_cnn(1, frozen=("conv1", "conv2", "fc1", "fc2")), x[:8]) is None
    dropout = find_prefix(wrapped(1, data, dropout=0.5), x[:8])
    assert dropout is not None and not dropout.train_exact  # scored shared, trained as is
    with without_savings():
        assert share_prefix(target, x) is None and FrozenStart.of(target) is None

    class Differing:
        """References whose backbone is not the target's: signals computed per model."""

        def __call__(self, rdata: DataSplits, seed: int, index: int) -> tuple:
            assert start_of(rdata) is not None
            return wrapped(10 + index, data), 0.0

    plan = plan_references(data=data, kind="offline", n_references=4, seed=0,
                           max_candidates=50)
    signals = collect_signals(target=target, data=data, plan=plan, trainer=Differing())
    xs = torch.cat([plan.candidates.x, plan.population.x])
    ys = torch.cat([plan.candidates.y, plan.population.y])
    own = per_example_signals(model=wrapped(10, data), x=xs, y=ys)
    n = len(plan.candidates)
    for name, values in own.items():
        np.testing.assert_array_equal(signals.references[name][0], values[:n])


def pretrained(data: DataSplits, seed: int) -> LayeredModel:
    """``tests/stock_nets.py``'s frozen backbone and trainable head, as a config names it."""
    torch.manual_seed(seed)
    return build_network(PRETRAINED, input_shape=data.input_shape, num_classes=10,
                         dataset=data.name, sample=data.shadow.x[:2]).eval()


def test_references_of_a_frozen_backbone_keep_it_frozen_and_the_targets(
        data: DataSplits) -> None:
    target = pretrained(data, 1)
    plan = plan_references(data=data, kind="offline", n_references=4, seed=0)
    x, _ = _xy(data)
    shared = share_prefix(target, x)
    start = training_start(FrozenStart.of(target), shared, target=target,
                           source=plan.source.x, rows=plan.train_rows)
    assert start is not None and start.training is not None
    rdata = reference_data(plan, data, index=0)
    seed = reference_seed(audit_seed=0, index=0)
    trainer = nonprivate_trainer(dataclasses.replace(RECIPE,
                                                     model_source=PRETRAINED.to_dict()))
    model, _ = trainer(with_start(rdata, start), seed, 0)
    untabled, _ = trainer(with_start(rdata, dataclasses.replace(start, training=None)), seed, 0)
    own, _ = trainer(rdata, seed, 0)  # no start: its own seeded backbone
    frozen = {n for n, p in target.named_parameters() if not p.requires_grad}
    params, targets, owns = (dict(m.named_parameters()) for m in (model, target, own))
    assert {n for n, p in params.items() if not p.requires_grad} == frozen
    assert all(torch.equal(params[name], targets[name]) for name in frozen)
    assert not torch.equal(owns["net.0.0.weight"], targets["net.0.0.weight"])
    assert not torch.equal(params["net.1.weight"], targets["net.1.weight"])
    for name, value in untabled.named_parameters():  # the stored outputs train the same model
        torch.testing.assert_close(params[name], value, rtol=RTOL, atol=ATOL)
    key = reference_key(trainer, with_start(rdata, start), seed=seed, index=0)
    assert key != reference_key(trainer, rdata, seed=seed, index=0)
    other = FrozenStart.of(pretrained(data, 2))
    assert key != reference_key(trainer, with_start(rdata, other), seed=seed, index=0)



def test_training_rows_the_audit_stored_are_not_run_again(
        data: DataSplits, monkeypatch: pytest.MonkeyPatch) -> None:
    """The online plan's candidates are training rows of its references: the training table
    takes their stored outputs and runs the prefix on the other rows only, and every training
    row's output matches the prefix run on it."""
    target = pretrained(data, 1)
    plan = plan_references(data=data, kind="online", n_references=4, seed=0,
                           max_candidates=100)
    shared = share_prefix(target, plan.candidates.x)
    assert shared is not None
    ran: list[int] = []
    real = prefix_module.prefix_outputs

    def counting(model: LayeredModel, prefix: object, x: torch.Tensor, **kw: object
                 ) -> torch.Tensor:
        ran.append(x.shape[0])
        return real(model, prefix, x, **kw)

    monkeypatch.setattr(prefix_module, "prefix_outputs", counting)
    start = training_start(FrozenStart.of(target), shared, target=target,
                           source=plan.source.x, rows=plan.train_rows)
    used = plan.source.x[np.unique(np.concatenate(plan.train_rows))]
    assert start is not None and start.training is not None
    assert len(used) > len(plan.candidates) and ran == [len(used) - len(plan.candidates)]
    stored = start.training.table.rows(used)
    assert stored is not None
    torch.testing.assert_close(stored, real(target, shared.prefix, used), rtol=RTOL, atol=ATOL)

def test_a_dp_reference_starts_from_the_targets_backbone(data: DataSplits) -> None:
    base = plan_trial(check(tiny_config()), trial_id="dp", data=data)
    spec = dataclasses.replace(base, user_model=PRETRAINED.to_dict(), randomness=REPRODUCIBLE)
    target = pretrained(data, 3)
    plan = plan_references(data=data, kind="offline", n_references=4, seed=0)

    def budget(size: int) -> Budget:
        cal, curve = match_budget(method=spec.method, params=dict(spec.method_params),
                                  dataset_size=size, batch_size=spec.batch_size,
                                  epochs=spec.epochs, epsilon=spec.calibration.target_epsilon,
                                  delta=spec.calibration.delta, cache_dir=None, timeout_s=120.0)
        return Budget(calibration=cal, epsilon_curve=curve)

    x, _ = _xy(data)
    start = training_start(FrozenStart.of(target), share_prefix(target, x), target=target,
                           source=plan.source.x, rows=plan.train_rows)
    assert start is not None and start.training is not None
    rdata = reference_data(plan, data, index=1)
    seed = reference_seed(audit_seed=0, index=1)
    trainer = dp_trainer(spec, budgets=budget)
    model, _ = trainer(with_start(rdata, start), seed, 1)
    untabled, _ = trainer(with_start(rdata, dataclasses.replace(start, training=None)), seed, 1)
    target_state = target.state_dict()
    for name, param in model.named_parameters():
        if name.startswith("net.0."):
            assert not param.requires_grad and torch.equal(param, target_state[name])
        else:
            assert param.requires_grad and not torch.equal(param, target_state[name])
    assert "forward" not in vars(model.blocks["0"])  # the table is gone with the training
    for name, value in untabled.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], value, rtol=RTOL,
                                   atol=ATOL)
    assert trainer.describe(with_start(rdata, start), seed, 1)["frozen_start"] == start.digest


def test_prefix_outputs_follow_the_forward_in_eval_mode(data: DataSplits) -> None:
    target = wrapped(1, data, dropout=0.5)
    x, _ = _xy(data)
    prefix = find_prefix(target, x[:8])
    assert prefix is not None
    target.train()
    outputs = prefix_outputs(target, prefix, x[:30], batch=7)
    assert target.training  # the caller's mode is restored
    target.eval()
    with torch.no_grad():
        _, irs = target.forward_with_irs(x[:30])
    torch.testing.assert_close(outputs, irs["body"], rtol=0, atol=0)


def test_token_ids_reach_the_signals_as_integers(data: DataSplits) -> None:
    net = nn.Sequential(nn.Embedding(17, 4), nn.Flatten(), nn.Linear(4 * 64, 10))
    tokens = data.shadow.x[:40].reshape(40, -1).round().clamp(0, 16).long()
    model = wrap_checked(net, layers=(), sample=tokens[:2], num_classes=10)
    out = per_example_signals(model=model, x=tokens, y=data.shadow.y[:40])
    assert all(np.isfinite(v).all() and v.shape == (40,) for v in out.values())
