"""The one-run canary audit (Steinke, Nasr & Jagielski, arXiv 2305.08846) against known answers.

* the canary gradient view equals explicit concatenation of the canaries' Dirac gradients;
* the IN/OUT draws come from OS entropy: no seed that was set or written reproduces them;
* on digits at a claimed epsilon of 1, sound DP-SGD's white-box bound stays below 1, while two
  broken DP-SGDs (one layer left unclipped; a tenth of the declared noise) get a white-box bound
  above 1 and ``audit_contradicts`` in their results row;
* black-box canaries are mislabelled holdout examples, disjoint from every split the trial uses;
* the white-box instrument enters every registered method x mode without a subclass.

The trials are ``dpsweep train`` run directories (``plan_trial``: the PRV accountant matches
epsilon 1; the three methods ask the same question, so the session's budget cache answers the
second and third).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from core.errors import UserInputError
from orchestrator.canary import audit_with_canaries
from orchestrator.config import PrivacyConfig
from orchestrator.rundir import RunDir
from orchestrator.single import TRIAL_ID, train_single
from reports import store
from tests.conformance import (
    SIGMA,
    STEPS_PER_EPOCH,
    build_step,
    digits,
    lifecycle_params,
    make_method,
)
from tests.conftest import tiny_config
from trainables.audit.canaries import (
    CANARY_NORM_FACTOR,
    CanaryView,
    WhiteBoxInstrument,
    choose_dirac_canaries,
    choose_input_canaries,
    draw_membership,
)
from trainables.dp_step import PerExampleGrads
from trainables.methods import METHODS, registered
from trainables.methods.dpsgd import DPSGD
from trainables.randomness import Randomness, poisson_batches

#: The claim every audited trial makes.
CLAIM = 1.0
DELTA = 1e-5
#: Digits, batch 50 of 500 (q = 0.1), 5 epochs = 50 steps: IN canaries join ~5 times each.
EPOCHS = 5
SAMPLE_RATE = 0.1
STEPS = 50
#: Layer left unclipped by the broken method: fc1 of digits_cnn (4,128 of 9,258 parameters, so
#: about 45% of the canaries land in it).
UNCLIPPED_LAYER = 2
#: The broken noise phase adds this fraction of the declared noise.
NOISE_FRACTION = 0.1
#: Steps of the every-method smoke run (two lifecycle epochs).
SMOKE_STEPS = 2 * STEPS_PER_EPOCH
CASES = [pytest.param(name, mode.name, id=f"{name}:{mode.name}")
         for name, cls in sorted(METHODS.items()) for mode in cls.modes]


# ---- test-only methods ---------------------------------------------------------------------------
class UnclippedLayerDPSGD(DPSGD):
    """Broken: flat clipping everywhere except one layer, whose blocks pass unscaled."""

    name: ClassVar[str] = "test_unclipped_layer"
    summary: ClassVar[str] = "broken DP-SGD (test only): one layer is never clipped"

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        coef = super().clip_coefficients(norms).clone()
        coef[:, UNCLIPPED_LAYER] = 1.0
        return coef


class TenthNoiseDPSGD(DPSGD):
    """Broken: the noise phase adds a tenth of the noise that ``noise_std`` (and hence the
    ledger) declares, so the trial's own ledger check cannot see it."""

    name: ClassVar[str] = "test_tenth_noise"
    summary: ClassVar[str] = "broken DP-SGD (test only): a tenth of the declared noise"

    def noise(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        noisy = super().noise(summed)
        return {n: s + NOISE_FRACTION * (noisy[n] - s) for n, s in summed.items()}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_run(tmp_path: Path, method: str) -> Path:
    """A one-trial run directory (``dpsweep train``) of ``method`` on digits at epsilon 1."""
    cfg = tiny_config(epochs=EPOCHS, method=method)
    cfg = dataclasses.replace(cfg, privacy=PrivacyConfig(epsilon=CLAIM, delta=DELTA))
    out = tmp_path / method
    train_single(cfg, out=out)  # plan_trial: the PRV accountant matches the budget
    return out


@pytest.fixture(scope="module")
def sound_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sound DP-SGD's trial, audited white-box and black-box by two tests."""
    return train_run(tmp_path_factory.mktemp("sound"), "dpsgd")


def in_out_gap(record: dict[str, Any]) -> tuple[float, float]:
    """Mean IN score minus mean OUT score, and its standard error."""
    scores = np.asarray(record["scores"])
    member = np.asarray(record["is_member"])
    a, b = scores[member], scores[~member]
    return float(a.mean() - b.mean()), float(np.sqrt(a.var() / len(a) + b.var() / len(b)))


def results_row(run_dir: Path) -> dict[str, Any]:
    frame = store.read_results(run_dir)
    return frame[frame["trial_id"] == TRIAL_ID].iloc[0].to_dict()


# ---- the canary view ----------------------------------------------------------------------------
def explicit_canary_grads(method: Any, canaries: Any, ids: list[int]) -> dict[str, torch.Tensor]:
    """The canaries' Dirac gradients written out, [k, *param.shape] per parameter."""
    params = dict(method.model.named_parameters())
    out = {n: torch.zeros(len(ids), *p.shape) for n, p in params.items()}
    for row, j in enumerate(ids):
        out[canaries.names[j]][row].view(-1)[canaries.index[j]] = canaries.magnitude
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


def test_canary_view_equals_explicit_concatenation() -> None:
    method = build_step("dpsgd")
    data = digits()
    x, y = data.train.x[:7], data.train.y[:7]
    base = method.gradients(x, y)
    canaries = choose_dirac_canaries(model=method.model, m=40, live=[True] * 4, magnitude=3.5,
                                     seed=3)
    ids = [0, 5, 6, 17, 39, 22]
    view = CanaryView(base, canaries, torch.tensor(ids))
    extra = explicit_canary_grads(method, canaries, ids)
    loops = per_example_grads_by_loop(method, x, y)
    torch.testing.assert_close(PerExampleGrads.from_grads(
        loops, layer_of=method.layer_of, num_layers=method.num_layers).norms, base.norms)
    explicit = PerExampleGrads.from_grads(
        {n: torch.cat([g, extra[n]]) for n, g in loops.items()},
        layer_of=method.layer_of, num_layers=method.num_layers)
    assert view.norms.shape == (7 + len(ids), 4)
    torch.testing.assert_close(view.norms, explicit.norms)
    for row, j in enumerate(ids):  # all of a canary's norm sits in its own layer
        expected = torch.zeros(4)
        expected[canaries.layer[j]] = 3.5
        torch.testing.assert_close(view.norms[7 + row], expected)
    coef = torch.rand(7 + len(ids), 4, generator=torch.Generator().manual_seed(0))
    got, want = view.weighted_sum(coef), explicit.weighted_sum(coef)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n])
    # The method's own clip phase on the view: each canary contributes exactly C e_k.
    clipped = method.clip(view)
    torch.testing.assert_close(clipped[canaries.names[ids[0]]].view(-1)[canaries.index[ids[0]]],
                               method.clip(base)[canaries.names[ids[0]]]
                               .view(-1)[canaries.index[ids[0]]] + 1.0, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="coef has shape"):
        view.weighted_sum(coef[:7])


def test_dirac_canaries_are_distinct_seeded_and_limited() -> None:
    model = build_step("dpsgd").model
    a = choose_dirac_canaries(model=model, m=1000, live=[True] * 4, magnitude=1.0, seed=0)
    b = choose_dirac_canaries(model=model, m=1000, live=[True] * 4, magnitude=1.0, seed=0)
    c = choose_dirac_canaries(model=model, m=1000, live=[True] * 4, magnitude=1.0, seed=1)
    coords = set(zip(a.names, a.index, strict=True))
    assert len(coords) == 1000  # distinct
    assert coords == set(zip(b.names, b.index, strict=True))
    assert coords != set(zip(c.names, c.index, strict=True))
    # Uniform over the 9,258 parameters: per-layer counts near 1000 x (160, 4640, 4128, 330).
    expected = np.array([160, 4640, 4128, 330]) / 9258 * 1000
    assert np.all(np.abs(np.array(a.layer_counts()) - expected) < 5 * np.sqrt(expected) + 1)
    frozen = choose_dirac_canaries(model=model, m=100, live=[True, False, True, True],
                                   magnitude=1.0, seed=0)
    assert 1 not in frozen.layer
    with pytest.raises(UserInputError) as info:
        choose_dirac_canaries(model=model, m=9259, live=[True] * 4, magnitude=1.0, seed=0)
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
    inst = WhiteBoxInstrument(m=m, seed=0, is_member=np.arange(m) % 2 == 0,
                              sampler=Randomness(kind="reproducible", device=torch.device("cpu"),
                                                 seed=1))
    inst(step)
    rows: list[int] = []
    clip = step.clip

    def counting_clip(view: Any) -> dict[str, torch.Tensor]:
        rows.append(int(view.norms.shape[0]))
        return clip(view)

    step.clip = counting_clip  # type: ignore[method-assign]
    data = digits()
    x, y = data.train.x[:500], data.train.y[:500]
    batch = 0
    for idx in poisson_batches(n=500, rate=0.1, steps=SMOKE_STEPS, randomness=Randomness(
            kind="reproducible", device=torch.device("cpu"), seed=5)):
        batch += len(idx)
        step.step(x[idx], y[idx])
    assert len(rows) == SMOKE_STEPS and inst.counts.steps == SMOKE_STEPS
    assert sum(rows) - batch == inst.counts.joins > 0
    # 100 IN canaries x 20 steps at q = 0.1: 200 expected joins (dropped: frozen layers).
    assert abs(inst.counts.joins + inst.counts.dropped - 200) < 5 * math.sqrt(180)
    assert np.isfinite(inst.scores).all() and np.count_nonzero(inst.scores) > m // 2


# ---- the audits on digits -----------------------------------------------------------------------
def test_white_box_bound_below_the_claim_for_sound_dpsgd(sound_run: Path) -> None:
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
    n_in = sum(run["is_member"])
    # Each IN canary joins each of the 50 steps with q = 0.1: Binomial(50 n_in, 0.1) joins.
    assert abs(run["joins"] - SAMPLE_RATE * STEPS * n_in) < 5 * math.sqrt(
        STEPS * n_in * SAMPLE_RATE * (1 - SAMPLE_RATE))
    assert run["steps"] == STEPS and run["dropped_joins"] == 0
    assert run["design"]["magnitude"] == CANARY_NORM_FACTOR * 1.0
    # A join adds exactly C = 1 to its coordinate after flat clipping: IN - OUT = q T C = 5.
    gap, se = in_out_gap(run)
    assert abs(gap - SAMPLE_RATE * STEPS) < 5 * se
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
    row = results_row(sound_run)
    assert (row["eps_lower_bound_kind"], row["canaries"]) == ("black-box", 300)
    run = json.loads((sound_run / audit.audit_file).read_text())["run"]
    assert run["steps"] == STEPS and len(run["design"]["labels"]) == 300
    assert all(s <= 0 for s in run["scores"])  # minus a cross-entropy


@pytest.mark.parametrize("broken", [UnclippedLayerDPSGD, TenthNoiseDPSGD])
def test_white_box_bound_contradicts_broken_dpsgd(tmp_path: Path, broken: type[DPSGD]) -> None:
    with registered(broken):
        run_dir = train_run(tmp_path, broken.name)
        assert results_row(run_dir)["dp_valid"]  # the broken method claims epsilon 1
        audit = audit_with_canaries(run_dir, trial_id=TRIAL_ID, canaries=1000, white_box=True,
                                    quiet=True)
    print(f"\n{broken.name} white-box: {audit.to_dict()}")
    assert audit.eps_lower_bound > CLAIM
    assert audit.contradicts
    row = results_row(run_dir)
    assert bool(row["audit_contradicts"]) and row["eps_lower_bound"] > row["epsilon_upper"]
    assert "CONTRADICTS" in audit.summary()
    if broken is TenthNoiseDPSGD:  # clipping intact: a join still adds exactly C = 1
        gap, se = in_out_gap(json.loads((run_dir / audit.audit_file).read_text())["run"])
        assert abs(gap - SAMPLE_RATE * STEPS) < 5 * se


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
