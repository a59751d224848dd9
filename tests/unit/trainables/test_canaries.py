"""The one-run canary audit (Steinke, Nasr & Jagielski, arXiv 2305.08846) against known answers.

* the canary gradient view equals explicit concatenation of the canaries' layer gradients;
* the layer canaries: one signed coordinate per canary in every layer, distinct where the layer
  has room and shared as evenly as possible where it has not, seeded;
* the IN/OUT draws come from OS entropy: no seed that was set or written reproduces them;
* for every method, exactly: with every canary joining every step and no noise, a canary's
  statistic in each layer is what the method's own rule lets it contribute (the instrument's
  ``shift``) when IN, and 0 when OUT;
* on digits at a claimed epsilon of 1, a sound method's white-box bound stays below 1 for flat
  and per-layer clipping alike (DP-SGD, LM-DP-SGD, DP-AdamILG);
* power on a per-layer method: DP-AdamILG adding a tenth of its declared noise gets a bound far
  above its claim of 1 (a single-coordinate canary got 0.96-1.58 there), and DP-SGD adding a
  tenth of its noise is contradicted through ``dpsweep audit`` too;
* black-box canaries are mislabelled holdout examples, disjoint from every split the trial
  uses, and a model that memorises them (no clipping, no noise) gets a bound far above 0;
* the white-box instrument enters every registered method x mode without a subclass.

The trials are digits at batch 50 of 500 (``plan_trial``: the PRV accountant matches epsilon 1;
methods asking the same question share the session's budget cache).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.core.trial import TrialSpec
from dpsweep.orchestrator.audit.canary import audit_with_canaries
from dpsweep.orchestrator.config import PrivacyConfig
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.orchestrator.trial.single import TRIAL_ID, train_single
from dpsweep.reports import store
from dpsweep.trainables.audit.canaries import (
    CANARY_NORM_FACTOR,
    CanaryView,
    WhiteBoxInstrument,
    choose_layer_canaries,
    draw_membership,
)
from dpsweep.trainables.audit.canary_runs import black_box_run, white_box_run
from dpsweep.trainables.audit.input_canaries import choose_input_canaries
from dpsweep.trainables.dp.randomness import Randomness, poisson_batches
from dpsweep.trainables.engine.grad_engine import MaterializedGrads
from dpsweep.trainables.engine.passes import LOOSE
from dpsweep.trainables.methods import METHODS, registered
from dpsweep.trainables.methods.dp_adamilg import DPAdamILG
from dpsweep.trainables.methods.dpsgd import DPSGD
from tests.conftest import tiny_config
from tests.contract.conformance import (
    SIGMA,
    STEPS_PER_EPOCH,
    build_step,
    digits,
    lifecycle_params,
    make_method,
)

#: The claim every audited trial makes.
CLAIM = 1.0
#: The models' own float32 rounding, below which a certified norm may sit under a reference.
CERTIFIED_RTOL = 1e-5
DELTA = 1e-5
#: Digits, batch 50 of 500 (q = 0.1), 5 epochs = 50 steps: IN canaries join ~5 times each.
EPOCHS = 5
SAMPLE_RATE = 0.1
STEPS = 50
#: The broken noise phases add this fraction of the declared noise.
NOISE_FRACTION = 0.1
#: A white-box bound the tenth-noise DP-AdamILG must exceed: 20 runs of it gave 2.23-2.75,
#: while a single-coordinate (Dirac) canary, which sees one layer's share, gave 0.96-1.58.
PER_LAYER_POWER = 1.5
#: The non-private trial that memorises black-box canaries: lr 1, 40 epochs; 22 runs gave
#: bounds of 2.30-3.32, most from 75 IN and 75 OUT guesses (145-150 right), one from 30 + 30.
LEAKY_LR = 1.0
LEAKY_EPOCHS = 40
LEAKY_BOUND = 1.5
#: The exact contribution test: whole-batch steps on this many training examples.
REFERENCE = 200
EXACT_STEPS = 6
#: Steps of the every-method smoke run (two lifecycle epochs).
SMOKE_STEPS = 2 * STEPS_PER_EPOCH
CASES = [pytest.param(name, mode.name, id=f"{name}:{mode.name}")
         for name, cls in sorted(METHODS.items()) for mode in cls.modes]
LAYERS = 4  # digits_cnn: conv1 (160 parameters), conv2 (4,640), fc1 (4,128), fc2 (330)


# ---- test-only methods ---------------------------------------------------------------------------
def _tenth(noisy: dict[str, torch.Tensor],
           summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: s + NOISE_FRACTION * (noisy[n] - s) for n, s in summed.items()}


class TenthNoiseDPSGD(DPSGD):
    """Broken: the noise phase adds a tenth of the noise that ``noise_std`` (and hence the
    ledger) declares, so the trial's own ledger check cannot see it."""

    name: ClassVar[str] = "test_tenth_noise"
    summary: ClassVar[str] = "broken DP-SGD (test only): a tenth of the declared noise"

    def noise(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _tenth(super().noise(summed), summed)


class TenthNoiseAdamILG(DPAdamILG):
    """Broken per-layer method: DP-AdamILG's layer noise, a tenth of what it declares."""

    name: ClassVar[str] = "test_tenth_noise_adamilg"
    summary: ClassVar[str] = "broken DP-AdamILG (test only): a tenth of the declared noise"

    def noise(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _tenth(super().noise(summed), summed)


class NonPrivateSGD(DPSGD):
    """Broken on purpose: neither clipping (not even the guard) nor noise."""

    name: ClassVar[str] = "test_non_private"
    summary: ClassVar[str] = "plain SGD under a DP name (test only)"

    def clip(self, view: Any) -> dict[str, torch.Tensor]:
        return view.weighted_sum(torch.ones_like(view.norms))

    def noise(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return summed


pytestmark = pytest.mark.usefixtures("one_thread")


def claim_config(method: str, **training: Any) -> Any:
    """Digits at batch 50 of 500, ``EPOCHS`` epochs, claiming epsilon ``CLAIM``."""
    cfg = tiny_config(**{"epochs": EPOCHS, "method": method, **training})
    return dataclasses.replace(cfg, privacy=PrivacyConfig(epsilon=CLAIM, delta=DELTA))


def train_run(tmp_path: Path, method: str) -> Path:
    """A one-trial run directory (``dpsweep train``) of ``method`` on digits at epsilon 1."""
    out = tmp_path / method
    train_single(check(claim_config(method)), out=out)  # plan_trial: the PRV accountant matches it
    return out


def trial_spec(method: str, **params: Any) -> TrialSpec:
    """The planned trial of ``method`` (default mode) at epsilon 1, ``params`` overriding."""
    cfg = claim_config(method)
    setup = check(cfg)
    return plan_trial(setup, params={**setup.trial_params(method), **params})


@pytest.fixture(scope="module")
def sound_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sound DP-SGD's trial, audited white-box and black-box by two tests."""
    return train_run(tmp_path_factory.mktemp("sound"), "dpsgd")


def results_row(run_dir: Path) -> dict[str, Any]:
    frame = store.read_results(run_dir)
    return frame[frame["trial_id"] == TRIAL_ID].iloc[0].to_dict()


# ---- the canary view ----------------------------------------------------------------------------
def explicit_canary_grads(method: Any, canaries: Any, ids: list[int],
                          live: list[bool]) -> dict[str, torch.Tensor]:
    """The canaries' gradients written out, [k, *param.shape] per parameter."""
    params = dict(method.model.named_parameters())
    out = {n: torch.zeros(len(ids), *p.shape) for n, p in params.items()}
    for name, (cid, flat, sign) in canaries.groups.items():
        layer = method.layer_of[name]
        for row, j in enumerate(ids):
            hit = (cid == j).nonzero().flatten()
            if live[layer] and len(hit):
                out[name][row].view(-1)[flat[hit]] = float(sign[hit]) * canaries.blocks[layer]
    return out


def per_example_grads_by_loop(method: Any, x: torch.Tensor, y: torch.Tensor
                              ) -> dict[str, torch.Tensor]:
    """Each example's gradient by its own backward pass (the engine never materialises them)."""
    params = dict(method.model.named_parameters())
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for i in range(len(x)):
        loss = torch.nn.functional.cross_entropy(method.model(x[i:i + 1]), y[i:i + 1])
        for n, g in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
            rows[n].append(g)
    return {n: torch.stack(g) for n, g in rows.items()}


@pytest.mark.parametrize("live", [[True] * LAYERS, [True, False, True, True]])
def test_canary_view_equals_explicit_concatenation(live: list[bool]) -> None:
    method = build_step("dpsgd")
    data = digits()
    x, y = data.train.x[:7], data.train.y[:7]
    base = method.engine.compute(x, y, live=live)
    canaries = choose_layer_canaries(model=method.model, m=40, norm=3.5, seed=3)
    ids = [0, 5, 6, 17, 39, 22]
    view = CanaryView(base, canaries, torch.tensor(ids), live)
    extra = explicit_canary_grads(method, canaries, ids, live)
    loops = {n: g for n, g in per_example_grads_by_loop(method, x, y).items()
             if live[method.layer_of[n]]}
    explicit = MaterializedGrads.from_grads(
        {n: torch.cat([g, extra[n]]) for n, g in loops.items()},
        layer_of=method.layer_of, num_layers=method.num_layers)
    assert view.norms.shape == (7 + len(ids), LAYERS)
    # the engine's ghost norms are certified upper bounds (a looser one is normed exactly)
    assert bool((view.norms >= explicit.norms * (1 - CERTIFIED_RTOL)).all())
    torch.testing.assert_close(view.norms, explicit.norms, rtol=LOOSE - 1, atol=0)
    expected = torch.tensor([b if on else 0.0 for b, on in zip(canaries.blocks, live,
                                                               strict=True)])
    for row in range(len(ids)):  # every canary: its block in every live layer, nothing else
        torch.testing.assert_close(view.norms[7 + row], expected.to(view.norms.dtype))
    coef = torch.rand(7 + len(ids), LAYERS, generator=torch.Generator().manual_seed(0))
    got, want = view.weighted_sum(coef), explicit.weighted_sum(coef)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n])
    with pytest.raises(ValueError, match="coef has shape"):
        view.weighted_sum(coef[:7])


def test_layer_canaries_cover_every_layer_seeded_and_evenly_shared() -> None:
    model = build_step("dpsgd").model
    a = choose_layer_canaries(model=model, m=1000, norm=100.0, seed=0)
    b = choose_layer_canaries(model=model, m=1000, norm=100.0, seed=0)
    c = choose_layer_canaries(model=model, m=1000, norm=100.0, seed=1)
    sizes = model.layer_sizes()
    uses: dict[int, list[str]] = {layer: [] for layer in range(LAYERS)}
    ids: dict[int, list[int]] = {layer: [] for layer in range(LAYERS)}
    for name, (cid, flat, sign) in a.groups.items():
        assert set(sign.tolist()) == {-1.0, 1.0}
        uses[a.layer_of[name]] += [f"{name}:{int(f)}" for f in flat]
        ids[a.layer_of[name]] += cid.tolist()
        other = b.groups[name]
        assert all(torch.equal(u, v) for u, v in zip(other, (cid, flat, sign), strict=True))
    # Every canary has exactly one coordinate in every layer.
    assert all(sorted(v) == list(range(1000)) for v in ids.values())
    for layer, coords in uses.items():
        counts = np.unique(coords, return_counts=True)[1]
        if sizes[layer] >= 1000:  # conv2, fc1: distinct
            assert counts.max() == 1
        else:  # conv1: 6 or 7 canaries per coordinate; fc2: 3 or 4
            low = 1000 // sizes[layer]
            assert set(counts.tolist()) <= {low, low + 1} and len(counts) == sizes[layer]
    assert [round(s, 2) for s in a.layer_sharing()] == [6.25, 1.0, 1.0, 3.03]
    assert any(not torch.equal(a.groups[n][1], c.groups[n][1]) for n in a.groups)
    # Blocks: 100 in all, the most where coordinates are plentiful, never below norm / (2 L).
    blocks = np.asarray(a.blocks)
    assert np.linalg.norm(blocks) == pytest.approx(100.0)
    assert blocks.min() > 100.0 / (2 * LAYERS) and np.argmax(blocks) == 1
    json.dumps(a.to_dict())
    with pytest.raises(UserInputError) as info:
        choose_layer_canaries(model=model, m=0, norm=1.0, seed=0)
    assert info.value.field == "canaries"


def test_membership_comes_from_os_entropy_not_from_seeds() -> None:
    draws = []
    for _ in range(2):  # every seed a caller could set or write, set identically
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        draws.append(draw_membership(1000))
    assert draws[0].dtype == bool and draws[0].shape == (1000,)
    assert not np.array_equal(draws[0], draws[1])  # equal with probability 2^-1000
    assert abs(draws[0].mean() - 0.5) < 0.08  # Binomial(1000, 1/2): 5 standard deviations
    with pytest.raises(UserInputError):
        draw_membership(0)


def test_input_canaries_are_mislabelled_holdout_examples() -> None:
    data = digits()
    canaries = choose_input_canaries(data, m=300, seed=0)
    assert canaries.m == 300
    assert bool((canaries.y != canaries.true_y).all())
    assert set(canaries.pool_indices) <= set(data.holdout.indices)
    for split in ("train", "validation", "test", "shadow"):
        assert not set(canaries.pool_indices) & set(getattr(data, split).indices)
    with pytest.raises(UserInputError) as info:
        choose_input_canaries(data, m=301, seed=0)
    assert info.value.field == "canaries" and "holdout" in info.value.allowed


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_white_box_canaries_enter_every_method_and_mode(method: str, mode: str) -> None:
    """The instrument works on every registered method x mode without a subclass: exactly the
    joining IN canaries are appended to the private batch's view (never to a public batch's,
    e.g. LM-DP-SGD's u), and every canary gets a finite score from the released gradient."""
    cls = METHODS[method]
    params = lifecycle_params(cls, mode)
    shape = cls.noise_shape(epochs=2, steps_per_epoch=STEPS_PER_EPOCH, params=params)
    step = make_method(cls, params=params, schedule=shape.scaled(SIGMA))
    m = 200
    data = digits()
    x, y = data.train.x[:500], data.train.y[:500]
    inst = WhiteBoxInstrument(m=m, seed=0, is_member=np.arange(m) % 2 == 0,
                              sampler=Randomness(kind="reproducible", device=torch.device("cpu"),
                                                 seed=1), reference=(x, y))
    inst(step)
    rows: list[int] = []
    clip = step.clip

    def counting_clip(view: Any) -> dict[str, torch.Tensor]:
        rows.append(int(view.norms.shape[0]))
        return clip(view)

    step.clip = counting_clip  # type: ignore[method-assign]
    batch = 0
    for idx in poisson_batches(n=500, rate=0.1, steps=SMOKE_STEPS, randomness=Randomness(
            kind="reproducible", device=torch.device("cpu"), seed=5),
            device=torch.device("cpu")):
        batch += len(idx)
        step.step(x[idx], y[idx])
    assert len(rows) == SMOKE_STEPS and inst.counts.steps == SMOKE_STEPS
    assert sum(rows) - batch == inst.counts.joins > 0
    # 100 IN canaries x 20 steps at q = 0.1: 200 expected joins (dropped: empty batches).
    assert abs(inst.counts.joins + inst.counts.dropped - 200) < 5 * math.sqrt(180)
    assert np.isfinite(inst.shift).all() and inst.shift.sum() > 0
    scores = inst.scores()
    assert np.isfinite(scores).all() and np.count_nonzero(scores) == m


# ---- the audits on digits -----------------------------------------------------------------------
@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_join_adds_the_methods_own_contribution_in_every_layer(method: str) -> None:
    """Known answer, exactly: every canary joins every step (rate 1), the batch is the whole
    reference set and the noise phase adds nothing, so an IN canary's statistic in layer l is
    sum_t a_l^2 / s_l^2 = ``shift[l]`` (a_l: what the method's own clipping lets one canary
    row contribute to layer l) and an OUT canary's is 0 (100 canaries: no shared coordinates;
    the data's expected sum is the data's sum)."""
    step = build_step(method)
    data = digits()
    x, y = data.train.x[:REFERENCE], data.train.y[:REFERENCE]
    step.ledger.sample_rate = 1.0
    step.expected_batch_size = float(REFERENCE)
    step.noise = lambda summed: summed  # type: ignore[method-assign]
    m = 100
    member = np.arange(m) % 2 == 0
    inst = WhiteBoxInstrument(m=m, seed=0, is_member=member, sampler=Randomness(
        kind="reproducible", device=torch.device("cpu"), seed=1), reference=(x, y))
    inst(step)
    for _ in range(EXACT_STEPS):
        step.step(x, y)
    assert np.all(inst.shift > 0)  # every layer carries signal
    scale = np.abs(inst.stats).max()
    np.testing.assert_allclose(inst.stats[member], np.broadcast_to(inst.shift, (m // 2, LAYERS)),
                               rtol=1e-3, atol=1e-5 * scale)
    np.testing.assert_allclose(inst.stats[~member], 0.0, atol=1e-5 * scale)


@pytest.mark.parametrize(("method", "params"), [("dpsgd", {}), ("lm_dpsgd", {}),
                                                ("dp_adamilg", {"lr": 0.03})])
def test_sound_white_box_bound_below_the_claim(method: str, params: dict[str, Any]) -> None:
    run = white_box_run(trial_spec(method, **params), m=1000, seed=0)
    bound = run.bound()
    print(f"\nsound {method} white-box: {bound.epsilon_lower:.3f} ({bound.best})")
    assert 0.99 * CLAIM <= run.claimed_epsilon <= CLAIM
    assert 0.0 <= bound.epsilon_lower < CLAIM
    # Each IN canary joins each of the 50 steps with q = 0.1: Binomial(50 n_in, 0.1) joins.
    n_in = sum(run.is_member)
    assert abs(run.joins + run.dropped_joins - SAMPLE_RATE * STEPS * n_in) < 5 * math.sqrt(
        STEPS * n_in * SAMPLE_RATE * (1 - SAMPLE_RATE))
    assert run.steps == STEPS


def test_white_box_power_on_a_per_layer_method() -> None:
    with registered(TenthNoiseAdamILG):
        spec = trial_spec(TenthNoiseAdamILG.name, lr=0.03)
        run = white_box_run(spec, m=1000, seed=0)
    bound = run.bound()
    print(f"\ntenth-noise dp_adamilg white-box: {bound.epsilon_lower:.3f} ({bound.best})")
    assert run.dp_valid and run.claimed_epsilon <= CLAIM
    assert bound.epsilon_lower > PER_LAYER_POWER > CLAIM


def test_white_box_audit_of_sound_dpsgd(sound_run: Path) -> None:
    claim = results_row(sound_run)["epsilon_upper"]
    assert 0.99 * CLAIM <= claim <= CLAIM
    audit = audit_with_canaries(sound_run, trial_id=TRIAL_ID, canaries=None, white_box=True,
                                quiet=True)
    print(f"\nsound dpsgd white-box: {audit.to_dict()}")
    assert audit.m == 1000 and audit.kind == "white-box"
    assert 0.0 <= audit.eps_lower_bound < CLAIM
    assert not audit.contradicts
    row = results_row(sound_run)
    assert row["eps_lower_bound"] == audit.eps_lower_bound
    assert (row["eps_lower_bound_kind"], row["canaries"], row["audit_contradicts"]) == (
        "white-box", 1000, False)
    run = json.loads((sound_run / audit.audit_file).read_text())["run"]
    assert run["steps"] == STEPS
    assert np.linalg.norm(run["design"]["blocks"]) == pytest.approx(CANARY_NORM_FACTOR * 1.0)
    # The files are in the manifest: a later reader verifies them.
    with RunDir.open(sound_run, write=False) as opened:
        opened.verify(audit.audit_file)
        opened.verify("results.parquet")


def test_black_box_audit_of_sound_dpsgd(sound_run: Path) -> None:
    audit = audit_with_canaries(sound_run, trial_id=TRIAL_ID, canaries=None, white_box=False,
                                quiet=True)
    print(f"\nsound dpsgd black-box: {audit.to_dict()}")
    assert audit.m == 300  # the digits holdout split bounds the pool
    assert 0.0 <= audit.eps_lower_bound < CLAIM and not audit.contradicts
    if audit.eps_lower_bound == 0:  # a zero reports the most guesses tried, not the fewest
        assert audit.r == 300
    row = results_row(sound_run)
    assert (row["eps_lower_bound_kind"], row["canaries"]) == ("black-box", 300)
    run = json.loads((sound_run / audit.audit_file).read_text())["run"]
    assert run["steps"] == STEPS and len(run["design"]["labels"]) == 300
    assert all(s <= 0 for s in run["scores"])  # minus a cross-entropy


def test_black_box_bound_on_a_model_that_memorises() -> None:
    """No clipping and no noise, 40 epochs: the mislabelled canaries that joined are fitted, so
    the black-box guesses (usually 75 IN and 75 OUT of 300 on digits) bound epsilon far above
    0."""
    with registered(NonPrivateSGD):
        cfg = claim_config(NonPrivateSGD.name, epochs=LEAKY_EPOCHS, lr=LEAKY_LR)
        run = black_box_run(plan_trial(check(cfg)), m=300, seed=0)
    bound = run.bound()
    print(f"\nnon-private black-box: {bound.epsilon_lower:.3f} ({bound.best})")
    assert bound.epsilon_lower > LEAKY_BOUND


def test_white_box_bound_contradicts_broken_dpsgd(tmp_path: Path) -> None:
    with registered(TenthNoiseDPSGD):
        run_dir = train_run(tmp_path, TenthNoiseDPSGD.name)
        assert results_row(run_dir)["dp_valid"]  # the broken method claims epsilon 1
        audit = audit_with_canaries(run_dir, trial_id=TRIAL_ID, canaries=1000, white_box=True,
                                    quiet=True)
    print(f"\n{TenthNoiseDPSGD.name} white-box: {audit.to_dict()}")
    assert audit.eps_lower_bound > CLAIM
    assert audit.contradicts
    row = results_row(run_dir)
    assert bool(row["audit_contradicts"]) and row["eps_lower_bound"] > row["epsilon_upper"]
    assert "CONTRADICTS" in audit.summary()


def test_audit_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as info:
        audit_with_canaries(tmp_path, trial_id="../x", canaries=None, white_box=True,
                            quiet=True)
    assert info.value.field == "trial id"
    with pytest.raises(UserInputError) as info:
        audit_with_canaries(tmp_path, trial_id="t", canaries=0, white_box=True, quiet=True)
    assert info.value.field == "--canaries"
    with pytest.raises(UserInputError) as info:
        audit_with_canaries(tmp_path, trial_id="t", canaries=10, white_box=True, quiet=True)
    assert info.value.field == "RUN_DIR"
