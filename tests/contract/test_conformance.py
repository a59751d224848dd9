"""Every registered method x mode, automatically: the lifecycle sensitivity check on the released
update, validity derived from the declaration, accounting against an independent accountant,
determinism under ``reproducible``, fresh randomness otherwise, and an exact checkpoint round
trip. A new method is tested here without writing a test file."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from dpsweep.core.events import events_from_list
from dpsweep.core.modes import INVALID_TAG
from dpsweep.core.schedule import Schedule
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.search_spaces import SPACES, build_space
from dpsweep.trainables.dp.contract import PUBLIC_SHARE
from dpsweep.trainables.dp.step import PublicData
from dpsweep.trainables.methods import METHODS
from dpsweep.trainables.training.loop import load_checkpoint_state, train_trial
from tests.conftest import tiny_config
from tests.contract.conformance import (
    SIGMA,
    check_release,
    digits,
    lifecycle,
    lifecycle_params,
    make_method,
    prepared_params,
)

CASES = [pytest.param(name, mode.name, id=f"{name}:{mode.name}")
         for name, cls in sorted(METHODS.items()) for mode in cls.modes]
#: PLD's discretisation against PRV's certified upper bound (relative).
INDEPENDENT_SLACK = 0.02
#: Steps and expected batch sizes of the public-data budget check.
PUBLIC_STEPS = 60
PUBLIC_BATCHES = (32, 128, 2000)


def _spec(method: str, mode: str, **training: object):
    """The trial's plan, its PRV calibration without a time bound: with the default 120 s a
    child interpreter on a host at load 24 ran past it, RDP answered instead (no lower bound),
    and the budget check failed on a busy machine only. What the PRV answers does not depend on
    how long it took."""
    cfg = tiny_config(**training)
    cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy,
                                                               accountant_timeout_s=math.inf))
    params = {**lifecycle_params(METHODS[method], mode), "lr": 0.5, "clip_norm": 1.0}
    spec = plan_trial(check(cfg), method=method, params=params)
    assert spec.calibration.fallback_reason is None, spec.calibration.fallback_reason
    return spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("method", "mode"), CASES)
def test_release_is_bounded_over_the_whole_lifecycle(method: str, mode: str,
                                                     dtype: torch.dtype) -> None:
    cls = METHODS[method]
    run = lifecycle(cls, mode, dtype=dtype)
    worst = max(run.releases, key=lambda c: (not c.holds, c.excess, c.rule_excess,
                                             c.granted / c.effective))
    if cls.mode_named(mode).dp_valid:
        assert worst.holds, f"sensitivity bound broken at {worst}"
        assert all(n.holds for n in run.noises), f"noise not as declared: {run.noises}"
    elif dtype == torch.float64:  # the neighbouring comparison runs where rounding is nil
        assert not worst.holds, "an unsound mode must be shown to violate its claimed bound"


@pytest.mark.parametrize(("method", "mode"), [c for c in CASES
                                              if METHODS[c.values[0]].mode_named(
                                                  c.values[1]).dp_valid])
def test_release_is_bounded_on_a_model_with_group_and_layer_norms(method: str,
                                                                  mode: str) -> None:
    """The engine's per-channel handlers (GroupNorm, LayerNorm) under the same checks, a few
    steps into training, in float32."""
    cls = METHODS[method]
    params = lifecycle_params(cls, mode)
    schedule = cls.noise_shape(epochs=1, steps_per_epoch=10, params=params).scaled(SIGMA)
    step = make_method(cls, params=params, schedule=schedule, model="norm")
    data = digits()
    for t in range(3):
        probe = copy.deepcopy(step)
        probe.begin_step(probe.step_count)
        check = check_release(probe, engine=True)
        assert check.holds, f"step {t}: {check}"
        step.step(data.train.x[t * 40:(t + 1) * 40], data.train.y[t * 40:(t + 1) * 40])


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_validity_is_derived_from_the_mode_declaration(method: str, mode: str) -> None:
    cls = METHODS[method]
    declared = cls.mode_named(mode)
    reason = declared.validity_reason(argument=cls.argument)
    assert (INVALID_TAG in reason) is (not declared.dp_valid)
    assert declared.dp_valid is all(s.name != "PRIVATE" for s in declared.sources.values())
    for statistic, source in declared.sources.items():
        assert statistic in reason and source.value in reason


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_declaration_presets_and_search_space_agree(method: str, mode: str) -> None:
    cls = METHODS[method]
    assert cls.summary and cls.argument
    decl = cls.declaration()
    assert {"mode", "lr", "clip_norm"} <= set(decl.names)
    assert all(p.doc for p in decl)
    for name, preset in cls.presets().items():
        assert cls.validate_params({k: v for k, v in preset.items()
                                    if not decl[k].modes or mode in decl[k].modes}), name
    space = build_space(method, mode=mode, num_layers=4)
    assert method in SPACES and space.contains(space.first_point)
    decoded = space.decode(space.first_point)
    assert cls.validate_params(decoded)["mode"] == mode


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_accounting_matches_the_budget_by_an_independent_accountant(tmp_path: Path, method: str,
                                                                    mode: str) -> None:
    from dpsweep.orchestrator.accounting.verify import epsilon_of_events, schedule_events

    spec = _spec(method, mode, reproducible=True)
    result = train_trial(spec, checkpoint_root=tmp_path)
    p = result.privacy_record
    schedule = spec.calibration.schedule
    expected = schedule_events(schedule, sample_rate=spec.calibration.sample_rate)
    # the ledger speaks core.events' vocabulary: it reads back as accounting events
    ledger = [(e.noise_multiplier, e.count) for e in events_from_list(p.ledger["events"])]
    phases = schedule.merged().phases
    # the ledger's multiplier is whitened over per-layer bounds (another code path than the
    # schedule's): equal to the last bits of the float, never below the certified one
    assert [c for _, c in ledger] == [ph.steps for ph in phases]
    for (recorded, _), ph in zip(ledger, phases, strict=True):
        assert recorded >= ph.noise_multiplier * (1 - 1e-12)
        assert math.isclose(recorded, ph.noise_multiplier, rel_tol=1e-12)
    independent = epsilon_of_events(expected, delta=p.delta, accountant="pld")
    assert independent <= p.target_epsilon * (1 + INDEPENDENT_SLACK)
    assert independent >= p.epsilon_lower * (1 - INDEPENDENT_SLACK)
    assert p.dp_valid is METHODS[method].mode_named(mode).dp_valid
    assert result.history[0]["epsilon_spent"] < result.history[-1]["epsilon_spent"]


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_reproducible_trials_replay_exactly_and_secret_ones_do_not(method: str,
                                                                   mode: str) -> None:
    spec = _spec(method, mode, reproducible=True)
    a, b = train_trial(spec), train_trial(spec)
    assert [m["val_accuracy"] for m in a.history] == [m["val_accuracy"] for m in b.history]
    assert [m["val_loss"] for m in a.history] == [m["val_loss"] for m in b.history]
    assert a.history[-1]["test_loss"] == b.history[-1]["test_loss"]
    secret = dataclasses.replace(spec, randomness="secret")
    c, d = train_trial(secret), train_trial(secret)
    assert [m["val_loss"] for m in c.history] != [m["val_loss"] for m in d.history]


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_checkpoint_round_trip_is_exact(tmp_path: Path, method: str, mode: str) -> None:
    spec = _spec(method, mode, reproducible=True, epochs=3)
    straight = train_trial(spec, checkpoint_root=tmp_path / "a")
    resumed = train_trial(spec, checkpoint_root=tmp_path / "b",
                          resume_from=tmp_path / "a" / "epoch_001")
    final_a = load_checkpoint_state(tmp_path / "a" / "epoch_003")["model"]
    final_b = load_checkpoint_state(tmp_path / "b" / "epoch_003")["model"]
    assert final_a.keys() == final_b.keys()
    for k in final_a:
        assert torch.equal(final_a[k], final_b[k]), k
    assert resumed.privacy_record.ledger == straight.privacy_record.ledger


def test_every_method_has_prepared_params_that_validate() -> None:
    for name, cls in METHODS.items():
        assert cls.validate_params(dict(prepared_params(name)))


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_public_refreshes_at_default_settings_stay_within_their_share(
        monkeypatch: pytest.MonkeyPatch, method: str, mode: str) -> None:
    """At its declared defaults a method processes at most PUBLIC_SHARE public examples per
    private one (beyond its first refresh), at any batch size, and says how often it draws
    them: the cost of public statistics must not grow as the batch shrinks."""
    cls = METHODS[method]
    drawn: list[int] = []
    batch = PublicData.batch

    def counting(self: PublicData, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        drawn.append(size)
        return batch(self, size)

    monkeypatch.setattr(PublicData, "batch", counting)
    params = cls.validate_params({**dict(prepared_params(method)), "mode": mode})
    for b in PUBLIC_BATCHES:
        drawn.clear()
        step = make_method(cls, params=params, expected_batch_size=float(b),
                           schedule=Schedule.constant(noise_multiplier=1.0, steps=10_000))
        for t in range(PUBLIC_STEPS):
            step.begin_step(t)
            step.step_count = t + 1
        if step.public_refresh_every is None:
            assert drawn == [], f"{method}:{mode} draws public data but declares no period"
            continue
        every = step.public_refresh_every
        assert len(drawn) == math.ceil(PUBLIC_STEPS / every), (b, every, drawn)
        assert sum(drawn) - drawn[0] <= PUBLIC_SHARE * PUBLIC_STEPS * b, (b, every, drawn)
        if every > 1:  # the fewest such steps: one step less would exceed the share
            assert drawn[0] > PUBLIC_SHARE * (every - 1) * b, (b, every)
