"""LM-DP-SGD through the conformance suite (one class per mode), plus what is specific to it."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from core.errors import UserInputError
from tests.conformance import (
    NORMS,
    NUM_LAYERS,
    SoundMethodConformance,
    UnsoundMethodConformance,
)
from trainables.data import load_splits
from trainables.dp_step import PerExampleGrads
from trainables.methods import get_method
from trainables.methods.lm_dpsgd import (
    LMDPSGD,
    Stage1,
    bias_optimal_weights,
    bias_terms,
    cache_path,
    calibrate,
    estimate_layer_risk,
    risk_identity,
    risk_terms,
)
from trainables.models import build_model
from trainables.training import train_trial

RISK = [0.45, 0.4, 0.35, 0.3]  # digits_cnn: deeper layers leakier, as the paper finds


def _own_property_test(test: Any) -> Any:
    """A fresh Hypothesis wrapper of the inherited property test for each class: one wrapper
    run on instances of several classes fails Hypothesis's differing_executors check."""
    return settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])(
        given(norms=NORMS)(test.hypothesis.inner_test))


class _Fixed:
    """The unit tests take a fixed risk vector instead of rerunning stage 1."""

    def prepared_params(self) -> dict[str, Any]:
        return {"risk": list(RISK)}


class _Sound(_Fixed, SoundMethodConformance):
    pass


class TestLMPublic(_Sound):
    method = "lm_dpsgd"
    method_params = {"mode": "public", "u_every": 3, "public_batch_size": 32}

    def test_weights_come_from_the_public_batch(self) -> None:
        step = self.make_step()
        before = step.weight_vector
        step.begin_step(0)
        after = step.weight_vector
        assert before != after  # uniform u replaced by the public estimate
        assert math.isclose(sum(v * v for v in after), 1.0, rel_tol=1e-9)
        step.begin_step(1)  # no refresh before u_every steps
        assert step.weight_vector == after

    def test_trial_record_carries_the_risk_vector(self) -> None:
        """Through plan_trial: the real stage 1 on digits (session cache) feeds the record."""
        result = train_trial(self.spec(epochs=1))
        rec = result.privacy["method_record"]
        assert (rec["mode"], rec["weights"], rec["r"]) == ("public", "risk", 3.0)
        assert len(rec["risk"]) == NUM_LAYERS == len(rec["risk_meta"]["attack_accuracy"])
        assert rec["risk"] == result.spec.method_params["risk"]
        assert rec["risk_meta"]["identity"]["dataset"] == "digits"
        assert result.privacy["validity_reason"].startswith("each example")
        history = result.history[-1]
        w = [history[f"lm_w_{name}"] for name in ("conv1", "conv2", "fc1", "fc2")]
        assert w == rec["final_weights"]
        assert sum(v * v for v in w) == pytest.approx(1.0)


class TestLMLagged(_Sound):
    method = "lm_dpsgd"
    method_params = {"mode": "lagged"}
    test_contribution_norm_bounded = _own_property_test(
        SoundMethodConformance.test_contribution_norm_bounded)

    def test_debiased_release_recovers_the_layer_mass(self) -> None:
        """With a pure-noise release the debiased estimate is ~0 (floored), with a noiseless
        one it is ||released block|| / w(l): the previous weights do not feed back."""
        step = self.make_step(sigma=1e-9)
        w0 = torch.tensor(step.weight_vector, dtype=torch.float64)
        target = torch.tensor([0.5, 0.1, 0.3, 0.2], dtype=torch.float64)  # ||u_l||, <= C
        noisy = {}
        first_param_of_layer: dict[int, str] = {}
        for n, p in step.model.named_parameters():
            first_param_of_layer.setdefault(step.layer_of[n], n)
            noisy[n] = torch.zeros_like(p, dtype=torch.float64)
        for layer, n in first_param_of_layer.items():
            block = noisy[n].view(-1)
            block[0] = float(w0[layer] * target[layer]) * step.expected_batch_size
        step.end_step(noisy)
        expected = calibrate(target, risk=torch.tensor(RISK), r=step.r)
        assert torch.allclose(torch.tensor(step.weight_vector, dtype=torch.float64), expected,
                              atol=1e-6)


    def test_pure_noise_releases_debias_to_nothing(self) -> None:
        """Releases of noise alone: the debiased layer mass is ~0, far below the raw noise
        energy n_l (sigma C / B)^2 / w_l^2 that an undebiased estimate would report."""
        step = self.make_step(sigma=1.0)
        zeros = {n: torch.zeros_like(p) for n, p in step.model.named_parameters()}
        w = torch.tensor(step.weight_vector, dtype=torch.float64)
        for _ in range(200):
            step._w = w.clone()  # hold w fixed to isolate the estimator
            step.end_step(step.noise(zeros))
        sizes = torch.tensor(step.model.layer_sizes(), dtype=torch.float64)
        raw = sizes * (1.0 * step.clip_norm / step.expected_batch_size) ** 2 / w**2
        estimate = step._lag_num / step._lag_den
        assert (estimate.abs() < 0.05 * raw).all(), (estimate, raw)


class TestLMBiasOptimal(_Sound):
    method = "lm_dpsgd"
    method_params = {"mode": "public", "weights": "bias_optimal", "u_every": 5}
    test_contribution_norm_bounded = _own_property_test(
        SoundMethodConformance.test_contribution_norm_bounded)


class TestLMFaithful(_Fixed, UnsoundMethodConformance):
    method = "lm_dpsgd"
    method_params = {"mode": "faithful"}

    def test_bias_optimal_faithful_also_moves_the_others(self) -> None:
        step = self.make_step(prepared={"risk": list(RISK), "weights": "bias_optimal"})
        assert step.dp_valid is False
        scales = torch.tensor([[1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 0.5, 0.2],
                               [0.3, 0.3, 3.0, 0.3]], dtype=torch.float64)
        grads = self.adversarial_grads(step, scales)
        step.clip(grads)
        w_before = step.weight_vector
        swapped = {n: g.clone() for n, g in grads.grads.items()}
        for g in swapped.values():
            g[0] = -1e3 * g[0]
        step.clip(PerExampleGrads.from_grads(swapped, layer_of=step.layer_of, num_layers=4))
        assert step.weight_vector != w_before  # example 0 re-weights examples 1 and 2

    def test_weights_are_the_papers_formula(self) -> None:
        step = self.make_step(clip_norm=1.0)
        norms = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]], dtype=torch.float64)
        step.clip_coefficients(norms)
        c = torch.tensor([1.0, 0.2])  # min(C, ||G_i||)
        u = (norms / c[:, None]).mean(dim=0)
        w = u * torch.tensor(RISK, dtype=torch.float64) ** step.r
        assert torch.allclose(torch.tensor(step.weight_vector, dtype=torch.float64),
                              w / w.norm(), atol=1e-12)


# ---- weights and clipping ------------------------------------------------------------------
def _step(**params: Any) -> LMDPSGD:
    return TestLMPublic().make_step(prepared={"risk": list(RISK), **params})


@pytest.mark.parametrize("r", [0.0, 1.0, 5.0])
def test_weight_vector_has_unit_norm(r: float) -> None:
    u = torch.tensor([0.3, 2.0, 1e-9, 7.0], dtype=torch.float64)
    w = calibrate(u, risk=torch.tensor(RISK), r=r)
    assert float(w.norm()) == pytest.approx(1.0, abs=1e-12)
    assert (w >= 0).all()


def test_r_zero_gives_the_risk_free_weights() -> None:
    u = torch.tensor([0.3, 2.0, 0.5, 7.0], dtype=torch.float64)
    assert torch.allclose(calibrate(u, risk=torch.tensor(RISK), r=0.0), u / u.norm())


def test_higher_r_shifts_weight_away_from_leaky_layers() -> None:
    u = torch.ones(4, dtype=torch.float64)
    w1 = calibrate(u, risk=torch.tensor(RISK), r=1.0)
    w5 = calibrate(u, risk=torch.tensor(RISK), r=5.0)
    assert w5[-1] / w5[0] < w1[-1] / w1[0] < 1.0


def test_er_above_chance_is_treated_as_chance() -> None:
    u = torch.ones(2, dtype=torch.float64)
    w = calibrate(u, risk=torch.tensor([0.5, 0.58]), r=5.0)
    assert torch.allclose(w, torch.full((2,), 2 ** -0.5, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(5))
def test_every_example_norm_is_exactly_its_clipped_norm(seed: int) -> None:
    """||G^_i|| = C_i = min(C, ||G_i||) for adversarial (wide-range, non-zero) layer norms."""
    step = _step(mode="public")
    step._w = calibrate(torch.rand(4, dtype=torch.float64) + 0.01, risk=step.risk, r=3.0)
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-12, 13, (16, NUM_LAYERS), generator=gen).double()
    norms = 10.0 ** exponents * torch.rand(16, NUM_LAYERS, generator=gen, dtype=torch.float64)
    coef = step.clip_coefficients(norms)
    clipped = norms.pow(2).sum(dim=1).sqrt().clamp(max=step.clip_norm)
    out = (coef * norms).pow(2).sum(dim=1).sqrt()
    assert torch.allclose(out, clipped, rtol=1e-9)
    assert torch.allclose(coef * norms / clipped[:, None],
                          step._w.expand(16, -1), rtol=1e-9)


def test_zero_block_gets_nothing_and_keeps_the_bound() -> None:
    step = _step(mode="public")
    norms = torch.tensor([[0.0, 3.0, 0.0, 4.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    coef = step.clip_coefficients(norms)
    assert coef[0, 0] == 0 and coef[0, 2] == 0 and (coef[1] == 0).all()
    assert float((coef[0] * norms[0]).norm()) <= step.clip_norm


def test_risk_terms_match_the_definition() -> None:
    norms = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0],
                          [0.1, 0.2, 0.2, 0.0]], dtype=torch.float64)
    u = risk_terms(norms, clip_norm=1.0)
    # C_i = 1, (0: skipped as 0), 0.3
    expected = torch.tensor([(3.0 + 0 + 1 / 3) / 3, (4.0 + 0 + 2 / 3) / 3, (0 + 0 + 2 / 3) / 3,
                             0.0], dtype=torch.float64)
    assert torch.allclose(u, expected)


# ---- bias-optimal weights ------------------------------------------------------------------
def _objective(w: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (w * w * a - 2 * w * b).sum(axis=-1)


@pytest.mark.parametrize("case", [
    ([1.0, 2.0, 3.0, 0.5], [0.3, 0.9, -0.4, 0.1]),
    ([0.2, 0.2, 4.0], [1.0, 0.5, 2.0]),  # tied minimum
    ([0.1, 1.0, 2.0], [0.0, 0.2, 0.3]),  # hard case: b = 0 on the argmin of a
    ([1.0, 1.0], [0.0, 0.0]),
])
def test_bias_optimal_weights_satisfy_the_optimality_conditions(case: tuple) -> None:
    a, b = (np.array(v) for v in case)
    w, lam = bias_optimal_weights(a, b)
    assert np.linalg.norm(w) == pytest.approx(1.0, abs=1e-12)  # feasibility
    assert np.allclose((a - lam) * w, b, atol=1e-9)  # stationarity: 2(a - lambda) w = 2 b
    assert (a - lam >= -1e-12).all()  # PSD Hessian: the global minimum on the sphere
    rng = np.random.default_rng(0)
    others = rng.normal(size=(20_000, len(a)))
    others /= np.linalg.norm(others, axis=1, keepdims=True)
    assert _objective(w, a, b) <= _objective(others, a, b).min() + 1e-12


def test_bias_optimal_from_gradients_minimises_the_bias() -> None:
    """On per-example gradients, w* beats the risk-free rule u/||u|| on Eq. (8)'s bias."""
    step = _step(mode="public", weights="bias_optimal")
    gen = torch.Generator().manual_seed(3)
    grads = {n: torch.randn(12, *p.shape, generator=gen, dtype=torch.float64) * (i + 1) * 0.1
             + 0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
             for i, (n, p) in enumerate(step.model.named_parameters())}
    pe = PerExampleGrads.from_grads(grads, layer_of=step.layer_of, num_layers=4)
    a, b = bias_terms(pe, layer_of=step.layer_of, num_layers=4, clip_norm=1.0)
    w, _ = bias_optimal_weights(a, b)
    u = risk_terms(pe.norms, clip_norm=1.0).numpy()

    def bias(weights: np.ndarray) -> float:
        coef = step.coefficients(pe.norms, torch.from_numpy(weights))
        total = 0.0
        for n, g in grads.items():
            layer = step.layer_of[n]
            mean_hat = torch.einsum("i,i...->...", coef[:, layer], g) / 12
            total += float((mean_hat - g.mean(dim=0)).pow(2).sum())
        return total

    assert bias(w) <= bias(u / np.linalg.norm(u)) + 1e-12
    assert bias(w) <= bias(np.full(4, 0.5)) + 1e-12


# ---- validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("params, field", [
    ({"mode": "private"}, "method_params.mode"),
    ({"weights": "optimal"}, "method_params.weights"),
    ({"r": -1.0}, "method_params.r"),
    ({"r": float("nan")}, "method_params.r"),
    ({"r": True}, "method_params.r"),
    ({"u_every": 0}, "method_params.u_every"),
    ({"public_batch_size": 2.5}, "method_params.public_batch_size"),
    ({"u_every": "often"}, "method_params.u_every"),
    ({"stage1_examples": 10}, "method_params.stage1_examples"),
    ({"er_eval": "test"}, "method_params.er_eval"),
    ({"lagged_beta": 1.0}, "method_params.lagged_beta"),
    ({"mode": "lagged", "weights": "bias_optimal"}, "method_params.weights"),
    ({"risk": [0.2, 1.5]}, "method_params.risk"),
    ({"rr": 1.0}, "method_params.rr"),
])
def test_bad_params_name_their_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(UserInputError) as err:
        LMDPSGD.validate_params(params)
    assert err.value.field == field


def test_risk_must_match_the_layers() -> None:
    with pytest.raises(UserInputError) as err:
        _step(risk=[0.4, 0.3])
    assert err.value.field == "method_params.risk"


def test_paper_preset_is_valid() -> None:
    preset = dict(LMDPSGD.presets["paper"])
    assert (preset.pop("lr"), preset.pop("clip_norm")) == (0.08, 1.0)
    assert LMDPSGD.validate_params(preset)["r"] == 5.0


def test_checkpoint_state_round_trips(tmp_path: Path) -> None:
    step = TestLMLagged().make_step()
    x, y = TestLMLagged().make_step().public_batch(20)
    for _ in range(3):
        step.step(x, y)
    path = tmp_path / "s.pt"
    torch.save(step.state_dict(), path)
    other = TestLMLagged().make_step()
    other.load_state_dict(torch.load(path, weights_only=True))
    assert other.weight_vector == step.weight_vector
    assert other.extra_record()["final_weights"] == step.extra_record()["final_weights"]


# ---- stage 1 -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _digits() -> Any:
    return load_splits(dataset="digits", seed=0)


def _factory() -> Any:
    return build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10)


def _prepare(cache: Path, *, seed: int = 0, **params: Any) -> tuple[dict[str, Any], float]:
    t = time.perf_counter()
    out = get_method("lm_dpsgd").prepare(data=_digits(), model_factory=_factory,
                                         params=params, seed=seed, cache_dir=cache)
    return out, time.perf_counter() - t


def test_stage1_on_digits_is_cached_and_keyed(tmp_path: Path) -> None:
    first, _ = _prepare(tmp_path)
    risk, meta = first["risk"], first["risk_meta"]
    assert len(risk) == NUM_LAYERS
    assert all(0.0 <= e <= 0.5 + 0.12 for e in risk), risk  # chance +- attack noise
    assert meta["shadow_train_accuracy"] >= 0.99  # the shadow overfits, as it must
    assert meta["er_eval"] == "heldout"
    assert meta["members"] == meta["nonmembers"] == 300
    again, seconds = _prepare(tmp_path)
    assert again == first and seconds < 0.5
    files = list((tmp_path / "lm_dpsgd_risk").glob("*"))
    assert [f.name for f in files] == [meta["cache_file"]]  # no temporary file left behind
    stage1 = Stage1.from_params(LMDPSGD.validate_params({}))
    paths = {cache_path(tmp_path, risk_identity(data=_digits(), model=_factory(), seed=s,
                                                stage1=st))
             for s, st in [(0, stage1), (1, stage1),
                           (0, dataclasses.replace(stage1, er_eval="train")),
                           (0, dataclasses.replace(stage1, steps=401))]}
    assert len(paths) == 4 and tmp_path / "lm_dpsgd_risk" / meta["cache_file"] in paths
    assert _prepare(tmp_path, risk=list(RISK))[0] == {}  # a given risk vector is kept


def test_stage1_is_deterministic_and_recomputes_a_damaged_cache(tmp_path: Path) -> None:
    stage1 = Stage1(examples=200, steps=30, batch_size=32, lr=3e-3, attack="logreg",
                    er_eval="train")
    a = estimate_layer_risk(data=_digits(), model_factory=_factory, seed=5, stage1=stage1,
                            cache_dir=tmp_path)
    path = next((tmp_path / "lm_dpsgd_risk").glob("*.json"))
    path.write_text("{not json")
    b = estimate_layer_risk(data=_digits(), model_factory=_factory, seed=5, stage1=stage1,
                            cache_dir=tmp_path)
    assert a == b
    assert a["risk_meta"]["er_eval"] == "train" and a["risk_meta"]["members"] == 100
