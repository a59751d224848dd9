"""The conformance suite every DP method and mode passes (like scikit-learn's estimator checks).

``tests/test_conformance.py`` parametrises it over the registry, so a new method is tested
without writing a test file. The central check, :func:`check_release`, does not trust the
method's own claims: at a given state it feeds adversarial per-example gradients through the
method's clip phase for a batch and for the batch without each example, *measures* the noise the
noise phase adds to each layer, and computes the step's effective multiplier

    mu = ( sum_l (d_l / s_l)^2 )^(-1/2),   d_l = ||clip(B)_l - clip(B \\ {k})_l||,

which must be at least the multiplier the calibrated schedule grants to the step. It runs at
every step of a short lifecycle (warm-up, controller and schedule changes, freezing) and after
a checkpoint resume into a fresh instance.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from core.schedule import Schedule
from trainables.data import load_splits
from trainables.dp_step import DPStep, PerExampleGrads, PublicData
from trainables.methods import get_method
from trainables.models import build_model
from trainables.randomness import Randomness, poisson_batches

NUM_LAYERS = 4  # digits_cnn
#: Steps of a lifecycle: 3 epochs of 10 steps, long enough for every fast_lifecycle change.
LIFECYCLE_STEPS = 30
STEPS_PER_EPOCH = 10
#: Step after which the lifecycle continues in a fresh instance restored from a checkpoint.
RESUME_AT = 17
#: Noise draws per check: the per-layer std estimate is within ~2% for digits_cnn's layers.
NOISE_DRAWS = 8
#: Relative slack for the measured multiplier (the std estimate's error, never the mechanism's).
TOLERANCE = 0.1
#: Adversarial per-example, per-layer gradient norms [B, L]: huge, an outlier among small ones,
#: spiky, zero and mixed blocks.
PATTERNS: dict[str, list[list[float]]] = {
    "huge": [[1e9] * NUM_LAYERS] * 4,
    "outlier": [[1e6] * NUM_LAYERS] + [[1.0] * NUM_LAYERS] * 4,
    "spike": [[1e-3, 1e-3, 1e8, 1e-3]] * 4,
    "zeros": [[0.0] * NUM_LAYERS] + [[1.0, 2.0, 3.0, 4.0]] * 4,
    "mixed": [[1e9, 0, 1e-9, 1], [0.1, 0.1, 0.1, 0.1], [5, 0, 0, 0], [0, 0, 0, 300],
              [1, 1, 1, 1], [1e4, 1e-4, 1e4, 1e-4]],
}
SIGMA = 1.3


@functools.lru_cache(maxsize=1)
def digits() -> Any:
    return load_splits(dataset="digits", seed=0)


@functools.cache
def prepared_params(method: str) -> tuple[tuple[str, Any], ...]:
    """What the method's once-per-sweep preparation adds (computed once per session)."""
    import tempfile

    cls = get_method(method)
    with tempfile.TemporaryDirectory() as tmp:
        out = cls.prepare(data=digits(), params=cls.validate_params({}), seed=0, cache_dir=tmp,
                          model_factory=lambda: build_model(name="digits_cnn",
                                                            input_shape=(1, 8, 8),
                                                            num_classes=10))
    return tuple(sorted(out.items()))


def lifecycle_params(cls: type[DPStep], mode: str,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The method's fast_lifecycle settings that its mode reads, plus preparation and extras."""
    decl = cls.declaration()
    fast = {k: v for k, v in cls.fast_lifecycle.items()
            if not decl[k].modes or mode in decl[k].modes}
    return {**fast, **dict(prepared_params(cls.name)), "mode": mode, **(extra or {})}


def make_method(cls: type[DPStep], *, params: dict[str, Any], schedule: Schedule,
                seed: int = 0, expected_batch_size: float = 50.0) -> DPStep:
    """The method on digits_cnn with reproducible randomness and the public pool."""
    data = digits()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10)
    return cls(model=model, params=params, noise_schedule=schedule, sample_rate=0.1,
               expected_batch_size=expected_batch_size, steps_per_epoch=STEPS_PER_EPOCH,
               randomness=Randomness(kind="reproducible", device=torch.device("cpu"), seed=seed),
               public=PublicData(x=data.shadow.x, y=data.shadow.y,
                                 generator=torch.Generator().manual_seed(seed + 7)))


def adversarial_view(method: DPStep, norms: torch.Tensor, *, seed: int = 1) -> PerExampleGrads:
    """Random per-example gradients of the live layers with the given block norms [B, L]."""
    gen = torch.Generator().manual_seed(seed)
    live = method.trainable_layers()
    grads = {n: torch.randn(norms.shape[0], *p.shape, generator=gen, dtype=torch.float64)
             for n, p in method.model.named_parameters() if live[method.layer_of[n]]}
    raw = PerExampleGrads.from_grads(grads, layer_of=method.layer_of,
                                     num_layers=method.num_layers)
    factor = torch.where(raw.norms > 0, norms / raw.norms, 0.0)
    scaled = {n: g * factor[:, method.layer_of[n]].reshape(-1, *[1] * (g.dim() - 1))
              for n, g in grads.items()}
    return PerExampleGrads.from_grads(scaled, layer_of=method.layer_of,
                                      num_layers=method.num_layers)


def _drop(view: PerExampleGrads, k: int, method: DPStep) -> PerExampleGrads:
    keep = [i for i in range(view.norms.shape[0]) if i != k]
    return PerExampleGrads.from_grads({n: g[keep] for n, g in view.grads.items()},
                                      layer_of=method.layer_of, num_layers=method.num_layers)


def measured_noise_std(method: DPStep, summed: dict[str, torch.Tensor]) -> list[float]:
    """Per-layer std of what the noise phase actually adds (a copy's draws; 0 if none)."""
    probe = copy.deepcopy(method)
    zeros = {n: torch.zeros_like(g) for n, g in summed.items()}
    sq = [0.0] * method.num_layers
    count = [0] * method.num_layers
    for _ in range(NOISE_DRAWS):
        for n, g in probe.noise(zeros).items():
            sq[method.layer_of[n]] += float(g.double().pow(2).sum())
            count[method.layer_of[n]] += g.numel()
    return [math.sqrt(s / c) if c else 0.0 for s, c in zip(sq, count, strict=True)]


@dataclass(frozen=True)
class ReleaseCheck:
    """The worst neighbouring pair at one state: its effective and its granted multiplier."""

    step: int
    pattern: str
    effective: float
    granted: float

    @property
    def holds(self) -> bool:
        return self.effective >= self.granted * (1 - TOLERANCE)


def check_release(method: DPStep) -> ReleaseCheck:
    """The smallest effective multiplier over the adversarial patterns and dropped examples,
    for the method's current state (begin_step already applied for this step)."""
    granted = method.sigma_at(method.step_count)
    worst: ReleaseCheck | None = None
    for name, pattern in PATTERNS.items():
        view = adversarial_view(method, torch.tensor(pattern, dtype=torch.float64))
        full_state = copy.deepcopy(method)
        full = full_state.clip(view)
        stds = measured_noise_std(full_state, full)
        for k in range(view.norms.shape[0]):
            rest = copy.deepcopy(method).clip(_drop(view, k, method))
            d = [0.0] * method.num_layers
            for n in full:
                d[method.layer_of[n]] += float((full[n] - rest.get(n, 0.0 * full[n]))
                                               .double().pow(2).sum())
            total = 0.0
            for dl, sl in zip(d, stds, strict=True):
                if dl > 0:
                    total = math.inf if sl == 0 else total + dl / sl ** 2
            effective = math.inf if total == 0 else 1.0 / math.sqrt(total)
            if worst is None or effective < worst.effective:
                worst = ReleaseCheck(step=method.step_count, pattern=name, effective=effective,
                                     granted=granted)
    assert worst is not None
    return worst


def restored(method: DPStep, *, params: dict[str, Any], schedule: Schedule) -> DPStep:
    """A fresh instance loaded from the method's checkpointable state (as a resume does)."""
    state = copy.deepcopy({"model": method.model.state_dict(), "method": method.state_dict()})
    fresh = make_method(type(method), params=params, schedule=schedule, seed=99)
    fresh.model.load_state_dict(state["model"])
    fresh.load_state_dict(state["method"])
    return fresh


def lifecycle(cls: type[DPStep], mode: str, *, extra: dict[str, Any] | None = None,
              steps: int = LIFECYCLE_STEPS, resume_at: int = RESUME_AT,
              schedule: Schedule | None = None) -> list[ReleaseCheck]:
    """Train on digits for ``steps`` Poisson steps, checking the release before every step;
    at ``resume_at`` continue in a fresh instance restored from the checkpointable state."""
    params = lifecycle_params(cls, mode, extra)
    if schedule is None:
        shape = cls.noise_shape(epochs=math.ceil(steps / STEPS_PER_EPOCH),
                                steps_per_epoch=STEPS_PER_EPOCH, params=params)
        schedule = shape.scaled(SIGMA)
    method = make_method(cls, params=params, schedule=schedule)
    data = digits()
    x, y = data.train.x[:500], data.train.y[:500]
    batches = poisson_batches(n=len(y), rate=0.1, steps=steps, randomness=Randomness(
        kind="reproducible", device=torch.device("cpu"), seed=5))
    checks = []
    for t, idx in enumerate(batches):
        if t == resume_at:
            method = restored(method, params=params, schedule=schedule)
        probe = copy.deepcopy(method)
        probe.begin_step(probe.step_count)
        checks.append(check_release(probe))
        method.step(x[idx], y[idx])
    return checks


def build_step(method: str, *, mode: str | None = None, clip_norm: float = 1.0,
               sigma: float = SIGMA, params: dict[str, Any] | None = None, seed: int = 0,
               steps: int = 10_000, prepared: bool = True) -> DPStep:
    """A method instance on digits_cnn with a long constant schedule, for unit tests: its
    default mode (or ``mode``), lr 0.1, clip_norm C, the once-per-sweep preparation unless
    ``prepared`` is False, then ``params`` on top."""
    cls = get_method(method)
    values: dict[str, Any] = {"lr": 0.1, "clip_norm": clip_norm}
    if prepared:
        values.update(dict(prepared_params(method)))
    if mode is not None:
        values["mode"] = mode
    values.update(params or {})
    return make_method(cls, params=cls.validate_params(values),
                       schedule=Schedule.constant(noise_multiplier=sigma, steps=steps),
                       seed=seed)
