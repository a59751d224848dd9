"""The conformance suite every DP method inherits (like optuna's pytest_samplers).

A method's test module subclasses :class:`MethodConformance`, names the method and its
hyperparameters, and gets: the sensitivity bound under adversarial per-example gradients, the
accounting check, determinism with a seed and an exact checkpoint round-trip.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.trial import plan_trial
from tests.conftest import tiny_config
from trainables.data import load_splits
from trainables.dp_step import DPStep, NoisePhase, PerExampleGrads
from trainables.methods import get_method
from trainables.models import build_model
from trainables.training import TrialSpec, load_checkpoint_state, train_trial

NUM_LAYERS = 4  # digits_cnn
ADVERSARIAL = st.sampled_from([0.0, 1e-12, 1e-6, 1e-3, 0.5, 1.0, 2.0, 1e3, 1e6, 1e12])
NORMS = st.integers(min_value=1, max_value=8).flatmap(
    lambda b: st.lists(st.lists(ADVERSARIAL | st.floats(0.0, 1e4), min_size=NUM_LAYERS,
                                max_size=NUM_LAYERS), min_size=b, max_size=b))


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@functools.lru_cache(maxsize=1)
def _digits_public() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_splits(dataset="digits", seed=0)
    return data.shadow.x, data.shadow.y


class MethodConformance:
    """Checks every method and mode must pass, sound or not."""

    method: ClassVar[str]
    method_params: ClassVar[dict[str, Any]] = {}
    #: False for modes whose epsilon claim does not hold (faithful paper variants).
    sound: ClassVar[bool] = True

    # ---- construction ------------------------------------------------------------------
    def make_step(self, *, clip_norm: float = 1.0, sigma: float = 1.3, seed: int = 0,
                  prepared: dict[str, Any] | None = None,
                  params: dict[str, Any] | None = None) -> DPStep:
        """A step on digits_cnn with a long constant schedule (no training data involved)."""
        torch.manual_seed(seed)
        model = build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10)
        cls = get_method(self.method)
        params = {**(self.method_params if params is None else params),
                  **(prepared if prepared is not None else self.prepared_params())}
        return cls(model=model, lr=0.1, clip_norm=clip_norm,
                   noise_schedule=[NoisePhase(noise_multiplier=sigma, steps=10_000)],
                   sample_rate=0.1, expected_batch_size=60.0,
                   noise_generator=torch.Generator().manual_seed(seed), steps_per_epoch=10,
                   public_data=_digits_public(),
                   public_generator=torch.Generator().manual_seed(seed + 7), **params)

    def prepared_params(self) -> dict[str, Any]:
        """What the method's once-per-sweep preparation adds (override to avoid recomputing)."""
        return {}

    def spec(self, **training: Any) -> TrialSpec:
        cfg = tiny_config(method=self.method, **training)
        cfg = dataclasses.replace(cfg, method_params=dict(self.method_params))
        return plan_trial(cfg)

    def adversarial_grads(self, step: DPStep, scales: torch.Tensor) -> PerExampleGrads:
        """Random per-example gradients whose layer blocks have the given norms [B, L]."""
        gen = torch.Generator().manual_seed(1)
        grads = {}
        for name, p in step.model.named_parameters():
            g = torch.randn(scales.shape[0], *p.shape, generator=gen, dtype=torch.float64)
            grads[name] = g
        raw = PerExampleGrads.from_grads(grads, layer_of=step.layer_of,
                                         num_layers=step.num_layers)
        factor = scales / raw.norms
        for name, g in grads.items():
            layer = step.layer_of[name]
            grads[name] = g * factor[:, layer].reshape(-1, *[1] * (g.dim() - 1))
        return PerExampleGrads.from_grads(grads, layer_of=step.layer_of,
                                          num_layers=step.num_layers)

    # ---- accounting --------------------------------------------------------------------
    def test_whitened_multiplier_is_the_calibrated_sigma(self) -> None:
        step = self.make_step(clip_norm=2.5, sigma=1.3)
        assert step.whitened_noise_multiplier() == pytest.approx(1.3, rel=1e-9)

    def test_trial_accounting(self, tmp_path: Path) -> None:
        spec = self.spec()
        result = train_trial(spec, checkpoint_root=tmp_path)
        p = result.privacy
        assert p["epsilon_upper"] <= p["target_epsilon"]
        assert p["epsilon_upper"] >= 0.99 * p["target_epsilon"]
        assert p["steps"] == sum(ph["steps"] for ph in p["noise_schedule"])
        assert p["dp_valid"] is self.sound
        assert p["sample_rate"] == pytest.approx(0.1)
        assert [m["epoch"] for m in result.history] == [1, 2]
        assert result.history[-1]["epsilon_spent"] == pytest.approx(p["epsilon_upper"], abs=0.02)
        assert result.history[0]["epsilon_spent"] < result.history[-1]["epsilon_spent"]

    # ---- determinism and checkpoints ---------------------------------------------------
    def test_deterministic_for_a_seed(self) -> None:
        spec = self.spec()
        a = train_trial(spec)
        b = train_trial(spec)
        c = train_trial(dataclasses.replace(spec, seed=spec.seed + 1))
        assert a.history == [{**m, "epoch_seconds": n["epoch_seconds"]}
                             for m, n in zip(b.history, a.history, strict=True)]
        assert a.test_accuracy == b.test_accuracy
        assert [m["train_loss"] for m in a.history] != [m["train_loss"] for m in c.history]

    def test_checkpoint_resume_is_exact(self, tmp_path: Path) -> None:
        spec = self.spec(epochs=3)
        straight = train_trial(spec, checkpoint_root=tmp_path / "a")
        resumed = train_trial(spec, checkpoint_root=tmp_path / "b",
                              resume_from=tmp_path / "a" / "epoch_001")
        final_a = load_checkpoint_state(tmp_path / "a" / "epoch_003")["model"]
        final_b = load_checkpoint_state(tmp_path / "b" / "epoch_003")["model"]
        assert final_a.keys() == final_b.keys()
        for k in final_a:
            assert torch.equal(final_a[k], final_b[k]), k
        assert resumed.privacy["ledger"] == straight.privacy["ledger"]
        assert [m["test_accuracy"] for m in resumed.history] == [
            m["test_accuracy"] for m in straight.history]


class SoundMethodConformance(MethodConformance):
    """A sound mode: every example's contribution is bounded by the declared sensitivity."""

    # ---- sensitivity -------------------------------------------------------------------
    @settings(max_examples=200, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.differing_executors])
    @given(norms=NORMS)
    def test_contribution_norm_bounded(self, norms: list[list[float]]) -> None:
        step = self.make_step()
        n = torch.tensor(norms, dtype=torch.float64)
        coef = step.clip_coefficients(n)
        assert coef.shape == n.shape
        assert torch.isfinite(coef).all()
        contribution = (coef * n).pow(2).sum(dim=1).sqrt()
        if self.sound:
            assert (contribution <= step.sensitivity() + 1e-6).all(), contribution
            bounds = step.layer_bounds()
            if bounds is not None:
                assert ((coef * n) <= torch.tensor(bounds, dtype=n.dtype) + 1e-6).all()

    @pytest.mark.parametrize("pattern", ["huge", "spike", "zeros", "mixed"])
    def test_neighbouring_batches_differ_by_at_most_sensitivity(self, pattern: str) -> None:
        """Removing any one example moves the clipped sum by <= the declared sensitivity."""
        step = self.make_step(clip_norm=0.7)
        b = 6
        scales = {
            "huge": torch.full((b, NUM_LAYERS), 1e9),
            "spike": torch.tensor([[1e-3, 1e-3, 1e8, 1e-3]] * b),
            "zeros": torch.tensor([[0.0, 0.0, 0.0, 0.0]] + [[1.0, 2.0, 3.0, 4.0]] * (b - 1)),
            "mixed": torch.tensor([[1e9, 0, 1e-9, 1], [0.1, 0.1, 0.1, 0.1], [5, 0, 0, 0],
                                   [0, 0, 0, 300], [1, 1, 1, 1], [1e4, 1e-4, 1e4, 1e-4]]),
        }[pattern].to(torch.float64)
        full = self.adversarial_grads(step, scales)
        summed = step.clip(full)
        for k in range(b):
            keep = [i for i in range(b) if i != k]
            part = PerExampleGrads.from_grads({n: g[keep] for n, g in full.grads.items()},
                                              layer_of=step.layer_of, num_layers=step.num_layers)
            rest = step.clip(part)
            diff = math.sqrt(sum(float((summed[n] - rest[n]).pow(2).sum()) for n in summed))
            assert diff <= step.sensitivity() * (1 + 1e-9) + 1e-6, (pattern, k, diff)


class UnsoundMethodConformance(MethodConformance):
    """A faithful paper mode whose epsilon claim fails: it must be flagged and shown to fail."""

    sound = False

    def test_flagged_invalid(self) -> None:
        step = self.make_step()
        assert step.dp_valid is False
        assert "invalid" in step.validity_reason

    def test_one_example_moves_the_others(self) -> None:
        """Replacing example 0 changes the clipping of examples 1.. (no per-example bound)."""
        step = self.make_step(clip_norm=0.7)
        scales = torch.tensor([[1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 0.5, 0.2],
                               [0.3, 0.3, 3.0, 0.3], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
        other = scales.clone()
        other[0] = torch.tensor([1e6, 1e-6, 1e-6, 1e6], dtype=torch.float64)
        a = step.clip_coefficients(scales)[1:]
        b = step.clip_coefficients(other)[1:]
        assert not torch.allclose(a, b), "the others' clipping should depend on example 0"
