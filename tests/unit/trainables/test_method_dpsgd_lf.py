"""DP-SGD-LF: from step t_f the first m_f layers get no gradient, no noise and no update, so
their weights stay bit-identical, while the accounting is DP-SGD's at every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.core.records import ACCOUNTANT_IMPLEMENTATIONS
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.trainables.dp.randomness import Randomness, poisson_batches
from dpsweep.trainables.methods.dpsgd_lf import DPSGDLayerFreeze
from dpsweep.trainables.training.loop import load_checkpoint_state, train_trial
from tests.conftest import tiny_config
from tests.contract.conformance import build_step, digits

FROZEN = ("blocks.conv1.", "blocks.conv2.")  # digits_cnn's lower half


def _train_steps(step: DPSGDLayerFreeze, steps: int) -> list[dict[str, torch.Tensor]]:
    """Run ``steps`` Poisson steps on digits; the weights before every step and at the end."""
    data = digits()
    x, y = data.train.x, data.train.y
    snapshots = []
    batches = poisson_batches(n=len(y), rate=0.1, steps=steps, randomness=Randomness(
        kind="reproducible", device=torch.device("cpu"), seed=3), device=torch.device("cpu"))
    for idx in batches:
        snapshots.append({n: p.detach().clone() for n, p in step.model.named_parameters()})
        step.step(x[idx], y[idx])
    snapshots.append({n: p.detach().clone() for n, p in step.model.named_parameters()})
    return snapshots


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_frozen_layers_stay_bit_identical_from_t_f(momentum: float) -> None:
    """With momentum too: a zero gradient would let the momentum buffer keep moving the
    weights, a missing one (grad None) leaves them and their optimizer state untouched."""
    step = build_step("dpsgd_lf", sigma=2.0, steps=20,
                      params={"t_f_fraction": 0.5, "momentum": momentum})
    assert (step.t_f, step.m_f) == (10, 2)  # round(0.5 * 20) steps, floor(4 / 2) layers
    w = _train_steps(step, 20)
    for name in w[0]:
        moved_before = not torch.equal(w[0][name], w[10][name])
        moved_after = not torch.equal(w[10][name], w[20][name])
        assert moved_before, f"{name} should train before t_f"
        assert moved_after is not name.startswith(FROZEN), name
    # freezing changes no accounting: every step is a sigma-step of the Gaussian mechanism
    assert step.ledger.events == [{"kind": "poisson_subsampled_gaussian",
                                   "sampling_probability": 0.1, "noise_multiplier": 2.0,
                                   "count": 20}]


def test_frozen_layers_get_no_noise_and_no_gradient() -> None:
    step = build_step("dpsgd_lf", clip_norm=1.0, sigma=2.0, steps=40)
    assert step.trainable_layers() == [True] * 4 and step.noise_std() == [2.0] * 4
    step.step_count = step.t_f  # frozen from here
    assert step.trainable_layers() == [False, False, True, True]
    assert step.noise_std() == [0.0, 0.0, 2.0, 2.0]
    view = step.gradients(torch.randn(5, 1, 8, 8), torch.arange(5))
    summed = view.weighted_sum(torch.ones_like(view.norms))
    assert sorted(summed) == sorted(n for n, _ in step.model.named_parameters()
                                    if not n.startswith(FROZEN))
    assert torch.all(view.norms[:, :2] == 0) and torch.all(view.norms[:, 2:] > 0)
    assert step.whitened_noise_multiplier() == pytest.approx(2.0)
    assert step.epoch_metrics()["frozen_layers"] == 2.0


@pytest.mark.parametrize(("m_f", "frozen"), [(1, [False, True, True, True]),
                                             (3, [False, False, False, True])])
def test_m_f_sets_the_frozen_depth(m_f: int, frozen: list[bool]) -> None:
    step = build_step("dpsgd_lf", steps=10, params={"m_f": m_f, "t_f_fraction": 0.0})
    assert step.t_f == 0 and step.trainable_layers() == frozen
    assert step.extra_record()["frozen_layers"] == step.model.layer_names[:m_f]


def test_paper_preset_freezes_late_with_the_papers_clip_norm() -> None:
    preset = DPSGDLayerFreeze.presets()["paper"]
    assert preset == {"clip_norm": 1.0, "t_f_fraction": 0.75, "m_f": 0}
    assert DPSGDLayerFreeze.validate_params(preset)["t_f_fraction"] == 0.75


@pytest.mark.parametrize(("params", "field"), [
    ({"m_f": 4}, "method_params.m_f"),  # all four layers: nothing left to train
    ({"m_f": -1}, "method_params.m_f"),
    ({"m_f": 1.5}, "method_params.m_f"),
    ({"t_f_fraction": 1.5}, "method_params.t_f_fraction"),
    ({"t_f_fraction": -0.1}, "method_params.t_f_fraction"),
    ({"freeze": 2}, "method_params.freeze"),
])
def test_bad_params(params: dict, field: str) -> None:
    with pytest.raises(UserInputError) as exc:
        build_step("dpsgd_lf", params=params)
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field} = ")



def test_it_declares_two_trained_layers_and_checks_m_f_within_them() -> None:
    """One trained layer leaves nothing to freeze while something trains: the method declares
    2 (config validation refuses a model with fewer where the config names it); within 2,
    m_f = 0 resolves to 1 and m_f = 2 leaves nothing to train."""
    assert DPSGDLayerFreeze.min_trained_layers == 2
    DPSGDLayerFreeze.check_setting(DPSGDLayerFreeze.validate_params({"m_f": 0}), num_layers=2,
                                   sizes={})
    with pytest.raises(UserInputError):
        DPSGDLayerFreeze.check_setting(DPSGDLayerFreeze.validate_params({"m_f": 2}),
                                       num_layers=2, sizes={})

def test_trial_freezes_at_t_f_and_records_it(tmp_path: Path) -> None:
    """Through plan_trial and the training loop: 2 epochs of 10 steps, t_f = end of epoch 1."""
    spec = plan_trial(check(tiny_config(reproducible=True)), method="dpsgd_lf",
                      params={"lr": 1.0, "clip_norm": 1.0, "t_f_fraction": 0.5, "m_f": 0})
    result = train_trial(spec, checkpoint_root=tmp_path)
    record = dict(result.privacy_record.method_record)
    # a reproducible trial keeps the cost model's plan (no timings: a replay takes its kernels)
    assert record.pop("engine_plan") == []
    assert record == {"t_f": 10, "t_f_fraction": 0.5, "m_f": 2,
                      "frozen_layers": ["conv1", "conv2"], "per_example_path": "engine",
                      "trained_layers": ["conv1", "conv2", "fc1", "fc2"],
                      "trained_parameters": 9258, "model_parameters": 9258,
                      "data_placement": "device"}
    at_tf = load_checkpoint_state(tmp_path / "epoch_001")["model"]
    end = load_checkpoint_state(tmp_path / "epoch_002")["model"]
    for name in at_tf:
        assert torch.equal(at_tf[name], end[name]) is name.startswith(FROZEN), name
    assert [m["frozen_layers"] for m in result.history] == [2.0, 2.0]
    assert result.privacy_record.ledger["events"][0]["count"] == 20
    # the record names what computed its epsilon, not a package that never ran
    versions = result.privacy_record.versions
    assert versions["accountant"] == ACCOUNTANT_IMPLEMENTATIONS[result.privacy_record.accountant]
    assert "prv_accountant" not in versions
