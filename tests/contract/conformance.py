"""The conformance suite every DP method and mode passes (like scikit-learn's estimator checks).

``tests/contract/test_conformance.py`` parametrises it over the registry, so a new method is tested
without writing a test file. Nothing in it trusts the method's own claims, and no check has
slack beyond floating-point rounding:

* :func:`check_release`, at a given state, feeds adversarial per-example gradients (huge, tiny,
  subnormal, zero, one layer dominating, aligned with the weights; as explicit gradients and as
  the real engine's view of crafted batches on the real model) through the method's clip phase
  *including the final guard*, and measures each example's **realised** contribution: the clip
  phase's output for that example alone, and (in float64, where rounding cannot hide anything)
  the difference between the batch's output with and without it. Every realised contribution
  must meet the declared bound (``layer_bounds()``, else ``sensitivity()``) within
  ``REL_TOL`` = 1e-6; the method's own coefficients must meet it before the guard caps them
  (a sound rule never leans on the guard); and the step's effective multiplier

      mu = ( sum_l (d_l / s_l)^2 )^(-1/2),   d_l the realised difference in layer l,
                                             s_l the declared noise std of layer l,

  must be at least the multiplier the calibrated schedule grants to the step, again within
  ``REL_TOL``.
* :func:`check_noise` measures what the noise phase actually adds, per layer, over
  ``NOISE_DRAWS`` >= 10^6 draws, against the declared std: the std's standard error is then
  0.07%, so ``NOISE_TOL`` = 0.5% is 7 standard errors (a false alarm about once in 10^12) and a
  1% shortfall is 14 standard errors past it.

Both run at every step of a short lifecycle (warm-up, controller and schedule changes, freezing)
and after a checkpoint resume into a fresh instance, in float32 and in float64. The default
workload is digits_cnn on digits; a :class:`Workload` runs the same checks on another model and
data (token ids included), any number of layers, and any engine strategy.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dpsweep.core.schedule import Schedule
from dpsweep.trainables.data.splits import load_splits
from dpsweep.trainables.dp.randomness import Randomness, poisson_batches
from dpsweep.trainables.dp.step import DPStep, PublicData
from dpsweep.trainables.engine.grad_engine import GradEngine, MaterializedGrads
from dpsweep.trainables.methods import get_method
from dpsweep.trainables.models.networks import LayeredModel, build_model

NUM_LAYERS = 4  # digits_cnn
#: Steps of a lifecycle: 3 epochs of 10 steps, long enough for every fast_lifecycle change.
LIFECYCLE_STEPS = 30
STEPS_PER_EPOCH = 10
#: Step after which the lifecycle continues in a fresh instance restored from a checkpoint.
RESUME_AT = 17
#: Steps of a lifecycle whose noise phase is measured (first, just resumed, last).
NOISE_STEPS = (0, RESUME_AT, LIFECYCLE_STEPS - 1)
#: Relative rounding allowed on a realised contribution and on the effective multiplier: the
#: float32 products c x g and their sums, nothing of the mechanism.
REL_TOL = 1e-6
#: Draws of the noise phase per layer, and the allowed relative error of the measured std.
NOISE_DRAWS = 1_000_000
NOISE_TOL = 0.005
#: Standard errors the mean of the measured noise may be away from 0.
MEAN_SIGMAS = 7.0
#: Adversarial per-example, per-layer gradient norms [B, L] as functions of the dtype's
#: smallest normal number ``tiny`` and the largest ``big``: blocks whose squared entries
#: underflow, blocks of subnormal entries, huge blocks, an outlier among small ones, one layer
#: dominating, zero and mixed blocks.
PATTERNS: dict[str, Callable[[float, float], list[list[float]]]] = {
    "huge": lambda tiny, big: [[big ** 0.25] * NUM_LAYERS] * 3,
    "outlier": lambda tiny, big: [[1e6] * NUM_LAYERS] + [[1.0] * NUM_LAYERS] * 3,
    "spike": lambda tiny, big: [[1e-3, 1e-3, 1e8, 1e-3]] * 3,
    "squares_underflow": lambda tiny, big: [[tiny ** 0.5 * 1e-2, 1.0, tiny ** 0.5, 1e-3],
                                            [tiny ** 0.5] * NUM_LAYERS, [1e-3] * NUM_LAYERS],
    "subnormal": lambda tiny, big: [[tiny * 1e-3 * 64, 0.5, tiny, 1.0],
                                    [tiny * 1e-3 * 64] * NUM_LAYERS],
    "zeros": lambda tiny, big: [[0.0] * NUM_LAYERS] + [[1.0, 2.0, 3.0, 4.0]] * 3,
    "mixed": lambda tiny, big: [[1e9, 0, 1e-9, 1], [0.1, 0.1, 0.1, 0.1], [5, 0, 0, 0],
                                [0, 0, 0, 300], [1e4, 1e-4, 1e4, 1e-4]],
}
#: Per-example multiples of the weights themselves (a gradient aligned with the weights).
ALIGNED = (1e-30, 1.0, 1e6)
#: Crafted real batches: the last layer's weights scaled by each factor, so that every earlier
#: layer's gradient scales with it (huge, squares underflowing, subnormal, exactly zero).
ENGINE_SCALES = (1e12, 1e-22, 1e-40, 0.0)
#: Steps of a lifecycle at which the real engine's view of crafted batches is checked.
ENGINE_STEPS = (0, 9, RESUME_AT, LIFECYCLE_STEPS - 1)
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


@dataclass(frozen=True)
class Workload:
    """What a conformance run trains on instead of digits_cnn on digits: the model, the
    private pool (Poisson-sampled), the public pool, the crafted batch of the engine views,
    the engine's strategy, and per method the parameters its once-per-sweep preparation would
    give for this model (its preparation runs on digits only; a method missing here gets
    none, and fails loudly if it needs them)."""

    model: Callable[[], LayeredModel]
    train: tuple[torch.Tensor, torch.Tensor]
    public: tuple[torch.Tensor, torch.Tensor]
    crafted: tuple[torch.Tensor, torch.Tensor]
    strategy: str = "auto"
    prepared: dict[str, dict[str, Any]] = field(default_factory=dict)


def _as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating inputs in the model's dtype; token ids stay integers."""
    return x.to(dtype) if x.is_floating_point() else x


def lifecycle_params(cls: type[DPStep], mode: str, extra: dict[str, Any] | None = None, *,
                     workload: Workload | None = None) -> dict[str, Any]:
    """The method's fast_lifecycle settings that its mode reads, plus preparation and extras."""
    decl = cls.declaration()
    fast = {k: v for k, v in cls.fast_lifecycle.items()
            if not decl[k].modes or mode in decl[k].modes}
    prepared = (dict(prepared_params(cls.name)) if workload is None
                else dict(workload.prepared.get(cls.name, {})))
    return {**fast, **prepared, "mode": mode, **(extra or {})}


def norm_model() -> LayeredModel:
    """A 4-layer digits model with every module the per-layer engine handles natively besides
    digits_cnn's: Conv2d + GroupNorm, Linear + LayerNorm, Linear."""
    nn = torch.nn
    return LayeredModel([
        ("conv1", nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Tanh())),
        ("conv2", nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.GroupNorm(4, 8),
                                nn.Tanh(), nn.Flatten())),
        ("fc1", nn.Sequential(nn.Linear(128, 32), nn.LayerNorm(32), nn.Tanh())),
        ("fc2", nn.Sequential(nn.Linear(32, 10))),
    ], num_classes=10)


#: The token task of ``every_module_model``: vocabulary (0 = padding), positions, classes.
VOCAB, POSITIONS, TOKEN_CLASSES = 16, 8, 4


class ToChannels(torch.nn.Module):
    """[B, T, D] -> [B, D, T]: a sequence's features as Conv1d channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class ToColumn(torch.nn.Module):
    """[B, C, T] -> [B, C, T, 1]: a sequence as a one-pixel-wide image for Conv2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-1)


class Gate(torch.nn.Module):
    """A parameterised module the engine has no algebra for (parameters used elementwise), so
    its block takes the exact ``torch.func`` path."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(-0.5, 0.5, channels).unsqueeze(1))
        self.shift = torch.nn.Parameter(torch.zeros(channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + torch.tanh(self.scale)) + self.shift


def every_module_model(*, gate: bool = False) -> LayeredModel:
    """Token ids [B, T] through every module the engine handles: Embedding (with padding_idx)
    + LayerNorm, Conv1d (grouped) + GroupNorm, Conv2d (strided, over the sequence as a
    column), Linear; with ``gate``, a fifth layer the engine has no algebra for."""
    nn = torch.nn
    blocks: list[tuple[str, nn.Module]] = [
        ("embed", nn.Sequential(nn.Embedding(VOCAB, 8, padding_idx=0), nn.LayerNorm(8),
                                ToChannels())),
        ("conv1d", nn.Sequential(nn.Conv1d(8, 8, 3, padding=1, groups=2), nn.GroupNorm(2, 8),
                                 nn.Tanh())),
        ("conv2d", nn.Sequential(ToColumn(), nn.Conv2d(8, 8, (3, 1), stride=(2, 1),
                                                       padding=(1, 0)), nn.Tanh())),
        ("head", nn.Sequential(nn.AdaptiveAvgPool2d((2, 1)), nn.Flatten(),
                               nn.Linear(16, TOKEN_CLASSES))),
    ]
    if gate:
        blocks.insert(2, ("gate", Gate(8)))
    return LayeredModel(blocks, num_classes=TOKEN_CLASSES)


def token_task(n: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable token task: ids [n, POSITIONS] in 1..VOCAB-1 where class k's marker token
    k + 1 appears two to four times (so tokens repeat within an example), and a padded tail
    (id 0) on every other example."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, TOKEN_CLASSES, (n,), generator=gen)
    x = torch.randint(TOKEN_CLASSES + 1, VOCAB, (n, POSITIONS), generator=gen)
    for i in range(n):
        spots = torch.randperm(POSITIONS - 2, generator=gen)[:2 + i % 3]
        x[i, spots] = int(y[i]) + 1
        if i % 2:
            x[i, POSITIONS - 2:] = 0
    return x, y


def token_workload(*, gate: bool = False, strategy: str = "auto") -> Workload:
    """``every_module_model`` on ``token_task`` (500 private, 500 public examples), with a
    per-layer risk vector for lm_dpsgd in place of its digits-only preparation."""
    layers = 5 if gate else 4
    x, y = token_task(500, seed=11)
    return Workload(model=functools.partial(every_module_model, gate=gate), train=(x, y),
                    public=token_task(500, seed=12), crafted=(x[:4], y[:4]), strategy=strategy,
                    prepared={"lm_dpsgd": {"risk": [0.45 - 0.05 * i for i in range(layers)]}})


def make_method(cls: type[DPStep], *, params: dict[str, Any], schedule: Schedule,
                seed: int = 0, expected_batch_size: float = 50.0,
                dtype: torch.dtype = torch.float32, model: str = "digits_cnn",
                workload: Workload | None = None) -> DPStep:
    """The method on digits_cnn (or ``norm_model``, or the workload's model, engine strategy
    and public pool) in ``dtype`` with reproducible randomness and the public pool."""
    if workload is None:
        data = digits()
        px, py = data.shadow.x, data.shadow.y
    else:
        px, py = workload.public
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if workload is not None:
            net = workload.model()
        else:
            net = norm_model() if model == "norm" else build_model(
                name=model, input_shape=(1, 8, 8), num_classes=10)
    method = cls(model=net.to(dtype), params=params, noise_schedule=schedule, sample_rate=0.1,
                 expected_batch_size=expected_batch_size, steps_per_epoch=STEPS_PER_EPOCH,
                 randomness=Randomness(kind="reproducible", device=torch.device("cpu"),
                                       seed=seed),
                 public=PublicData(x=_as_dtype(px, dtype), y=py,
                                   generator=torch.Generator().manual_seed(seed + 7)))
    if workload is not None and workload.strategy != method.engine.strategy:
        method.engine = GradEngine(method.model, strategy=workload.strategy,
                                   max_physical_batch=method.max_physical_batch)
    return method


def _dtype(method: DPStep) -> torch.dtype:
    return next(method.model.parameters()).dtype


def _view(method: DPStep, grads: dict[str, torch.Tensor]) -> MaterializedGrads:
    return MaterializedGrads.from_grads(grads, layer_of=method.layer_of,
                                      num_layers=method.num_layers)


def adversarial_view(method: DPStep, norms: torch.Tensor, *, seed: int = 1) -> MaterializedGrads:
    """Random per-example gradients of the live layers, in the model's dtype, with the given
    block norms [B, L] (as nearly as the dtype represents them: the view's norms are those of
    the gradients actually built)."""
    gen = torch.Generator().manual_seed(seed)
    live = method.trainable_layers()
    dtype = _dtype(method)
    grads = {n: torch.randn(norms.shape[0], *p.shape, generator=gen, dtype=torch.float64)
             for n, p in method.model.named_parameters() if live[method.layer_of[n]]}
    raw = _view(method, grads)
    factor = torch.where(raw.norms > 0, norms / raw.norms, 0.0)
    return _view(method, {n: (g * factor[:, method.layer_of[n]].reshape(
        -1, *[1] * (g.dim() - 1))).to(dtype) for n, g in grads.items()})


def aligned_view(method: DPStep) -> MaterializedGrads:
    """Per-example gradients that are multiples ``ALIGNED`` of the current weights."""
    live = method.trainable_layers()
    scale = torch.tensor(ALIGNED, dtype=_dtype(method))
    return _view(method, {n: scale.reshape(-1, *[1] * p.dim()) * p.detach().unsqueeze(0)
                          for n, p in method.model.named_parameters()
                          if live[method.layer_of[n]]})


def engine_views(method: DPStep, crafted: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> list[tuple[str, DPStep, Any]]:
    """(label, probe, view): the real engine's views of a crafted batch (digits' first four
    training examples unless given) on copies of the model whose last layer is scaled by each
    of ``ENGINE_SCALES``, plus inputs scaled by 1e15 (token ids: the first layer's parameters,
    which scales every later layer's input alike)."""
    dtype = _dtype(method)
    if crafted is None:
        crafted = (digits().train.x[:4], digits().train.y[:4])
    x, y = _as_dtype(crafted[0], dtype), crafted[1]
    out = []
    for scale in ENGINE_SCALES:
        probe = copy.deepcopy(method)
        with torch.no_grad():
            for p in list(probe.model.blocks.values())[-1].parameters():
                p.mul_(scale)
        out.append((f"engine:last*{scale:g}", probe, probe.gradients(x, y)))
    probe = copy.deepcopy(method)
    if x.is_floating_point():
        out.append(("engine:x*1e15", probe, probe.gradients(x * 1e15, y)))
        return out
    with torch.no_grad():
        for p in next(iter(probe.model.blocks.values())).parameters():
            p.mul_(1e15)
    out.append(("engine:first*1e15", probe, probe.gradients(x, y)))
    return out


def _only(view: Any, k: int, method: DPStep) -> MaterializedGrads | None:
    """Example k alone, as explicit gradients (None for an engine view, handled by masking)."""
    if not isinstance(view, MaterializedGrads):
        return None
    return _view(method, {n: g[k:k + 1] for n, g in view.grads.items()})


def _drop(view: MaterializedGrads, k: int, method: DPStep) -> MaterializedGrads:
    keep = [i for i in range(view.norms.shape[0]) if i != k]
    return _view(method, {n: g[keep] for n, g in view.grads.items()})


class _Masked:
    """An engine view restricted to example k: every other row's coefficient set to zero, so
    the clip phase's output is exactly what example k contributes through the engine."""

    def __init__(self, view: Any, k: int) -> None:
        self._view = view
        self.mask = torch.zeros(view.norms.shape[0], 1, dtype=view.norms.dtype)
        self.mask[k] = 1.0
        self.norms = view.norms * self.mask
        self.losses = view.losses

    def weighted_sum(self, coef: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._view.weighted_sum(coef * self.mask.to(coef.dtype))


def _fork(method: DPStep) -> DPStep:
    """A copy whose clip phase cannot change ``method`` (its own method state, guard counters
    and statistics), sharing the parts a clip only reads: model, engine, optimizer, pools."""
    shared = (method.model, method.engine, method.optimizer, method.public, method.randomness)
    return copy.deepcopy(method, memo={id(o): o for o in shared})


def _layer_sq(method: DPStep, sums: dict[str, torch.Tensor],
              minus: dict[str, torch.Tensor] | None = None) -> list[float]:
    """Per-layer squared L2 norm (float64) of a clip output, or of its difference to another."""
    d = [0.0] * method.num_layers
    for n, v in sums.items():
        diff = v.double() - (minus[n].double() if minus is not None and n in minus else 0.0)
        d[method.layer_of[n]] += float(diff.pow(2).sum())
    return d


@dataclass(frozen=True)
class ReleaseCheck:
    """The worst example at one state: realised over declared bound, the method's own rule
    over the bound (before the guard), and the effective against the granted multiplier."""

    step: int
    pattern: str
    excess: float
    rule_excess: float
    effective: float
    granted: float

    @property
    def holds(self) -> bool:
        return (self.excess <= 1 + REL_TOL and self.rule_excess <= 1 + REL_TOL
                and self.effective >= self.granted / (1 + REL_TOL))


def _excess(method: DPStep, d: list[float]) -> float:
    """Realised contribution (per-layer squared norms ``d``) over the declared bound."""
    bounds = method.layer_bounds()
    if bounds is not None:
        return max((math.sqrt(dl) / c if c > 0 else (math.inf if dl > 0 else 0.0))
                   for dl, c in zip(d, bounds, strict=True))
    total = math.sqrt(sum(d))
    bound = method.sensitivity()
    return total / bound if bound > 0 else (math.inf if total > 0 else 0.0)


def _effective(d: list[float], stds: list[float]) -> float:
    total = 0.0
    for dl, sl in zip(d, stds, strict=True):
        if dl > 0:
            total = math.inf if sl == 0 else total + dl / sl ** 2
    return math.inf if total == 0 else 1.0 / math.sqrt(total)


def _check_view(method: DPStep, name: str, view: Any) -> ReleaseCheck:
    """The worst example of one view at the method's state (see the module docstring)."""
    granted = method.sigma_at(method.step_count)
    full_state = _fork(method)
    full = full_state.clip(view)
    stds = full_state.noise_std()
    rule = full_state.last_guard_ratio
    neighbouring = isinstance(view, MaterializedGrads) and _dtype(method) == torch.float64
    worst: ReleaseCheck | None = None
    for k in range(view.norms.shape[0]):
        alone_view = _only(view, k, method) or _Masked(view, k)
        alone_state = _fork(method)
        d = _layer_sq(method, alone_state.clip(alone_view))
        excess = _excess(alone_state, d)
        if neighbouring:
            rest = _fork(method).clip(_drop(view, k, method))
            d = _layer_sq(method, full, rest)
            excess = max(excess, _excess(full_state, d))
        check = ReleaseCheck(step=method.step_count, pattern=name, excess=excess,
                             rule_excess=max(rule, alone_state.last_guard_ratio),
                             effective=_effective(d, stds), granted=granted)
        if worst is None or _badness(check) > _badness(worst):
            worst = check
    assert worst is not None
    return worst


def _badness(c: ReleaseCheck) -> float:
    return max(c.excess, c.rule_excess, c.granted / c.effective if c.effective else math.inf)


def pattern_norms(pattern: Callable[[float, float], list[list[float]]], *, tiny: float,
                  big: float, num_layers: int) -> torch.Tensor:
    """A pattern's [B, L] block norms for an L-layer model: its ``NUM_LAYERS`` columns,
    repeated cyclically (unchanged for L = ``NUM_LAYERS``)."""
    rows = pattern(tiny, big)
    return torch.tensor([[row[j % len(row)] for j in range(num_layers)] for row in rows],
                        dtype=torch.float64)


def check_release(method: DPStep, *, engine: bool = False,
                  crafted: tuple[torch.Tensor, torch.Tensor] | None = None,
                  patterns: bool = True) -> ReleaseCheck:
    """The worst example over the adversarial patterns (and, with ``engine``, the real
    engine's views of ``crafted``, see :func:`engine_views`) at the method's current state
    (begin_step applied). ``patterns`` False: the engine's views alone (the explicit
    patterns do not depend on the model's modules, and on an 11M-parameter model cost
    ~30 s)."""
    info = torch.finfo(_dtype(method))
    views: list[tuple[str, DPStep, Any]] = [
        (name, method, adversarial_view(method, pattern_norms(
            pattern, tiny=info.tiny, big=info.max, num_layers=method.num_layers)))
        for name, pattern in PATTERNS.items()] if patterns else []
    if patterns:
        views.append(("aligned", method, aligned_view(method)))
    if engine:
        views += engine_views(method, crafted)
    checks = [_check_view(state, name, view) for name, state, view in views]
    return max(checks, key=_badness)


@dataclass(frozen=True)
class NoiseCheck:
    """Measured against declared noise std per layer at one state."""

    step: int
    declared: tuple[float, ...]
    measured: tuple[float, ...]
    mean_z: tuple[float, ...]

    @property
    def holds(self) -> bool:
        return all((s == 0 and m == 0) or (s > 0 and abs(m / s - 1) <= NOISE_TOL)
                   for s, m in zip(self.declared, self.measured, strict=True)) \
            and all(abs(z) <= MEAN_SIGMAS for z in self.mean_z)


def check_noise(method: DPStep) -> NoiseCheck:
    """What the noise phase adds to each layer, over ``NOISE_DRAWS`` draws per layer (a copy's
    noise phase on zero sums shaped so that every layer gets that many draws)."""
    probe = copy.deepcopy(method)
    declared = probe.noise_std()
    dtype = _dtype(method)
    names: dict[int, list[str]] = {}
    for n, _ in method.model.named_parameters():
        names.setdefault(method.layer_of[n], []).append(n)
    zeros = {n: torch.zeros(math.ceil(NOISE_DRAWS / len(group)), dtype=dtype)
             for group in names.values() for n in group}
    out = probe.noise(zeros)
    measured, mean_z = [], []
    for layer in range(method.num_layers):
        x = torch.cat([out[n].double() for n in names.get(layer, [])])
        std = float(x.pow(2).mean().sqrt())
        measured.append(std)
        mean_z.append(float(x.mean()) / std * math.sqrt(x.numel()) if std > 0 else 0.0)
    return NoiseCheck(step=method.step_count, declared=tuple(declared),
                      measured=tuple(measured), mean_z=tuple(mean_z))


def restored(method: DPStep, *, params: dict[str, Any], schedule: Schedule,
             workload: Workload | None = None) -> DPStep:
    """A fresh instance loaded from the method's checkpointable state (as a resume does)."""
    state = copy.deepcopy({"model": method.model.state_dict(), "method": method.state_dict()})
    fresh = make_method(type(method), params=params, schedule=schedule, seed=99,
                        dtype=_dtype(method), workload=workload)
    fresh.model.load_state_dict(state["model"])
    fresh.load_state_dict(state["method"])
    return fresh


@dataclass(frozen=True)
class Lifecycle:
    """Every release check and noise check of one lifecycle."""

    releases: list[ReleaseCheck]
    noises: list[NoiseCheck]


def lifecycle(cls: type[DPStep], mode: str, *, extra: dict[str, Any] | None = None,
              steps: int = LIFECYCLE_STEPS, resume_at: int = RESUME_AT,
              schedule: Schedule | None = None,
              dtype: torch.dtype = torch.float32, workload: Workload | None = None,
              engine_steps: tuple[int, ...] = ENGINE_STEPS,
              noise_steps: tuple[int, ...] = NOISE_STEPS) -> Lifecycle:
    """Train on digits (or the workload) in ``dtype`` for ``steps`` Poisson steps, checking the
    release before every step (with the real engine's views at ``engine_steps``) and the noise
    phase at ``noise_steps``; at ``resume_at`` continue in a fresh instance restored from the
    checkpointable state."""
    params = lifecycle_params(cls, mode, extra, workload=workload)
    if schedule is None:
        shape = cls.noise_shape(epochs=math.ceil(steps / STEPS_PER_EPOCH),
                                steps_per_epoch=STEPS_PER_EPOCH, params=params)
        schedule = shape.scaled(SIGMA)
    method = make_method(cls, params=params, schedule=schedule, dtype=dtype, workload=workload)
    if workload is None:
        x, y = digits().train.x[:500].to(dtype), digits().train.y[:500]
    else:
        x, y = _as_dtype(workload.train[0], dtype), workload.train[1]
    crafted = None if workload is None else workload.crafted
    batches = poisson_batches(n=len(y), rate=0.1, steps=steps, randomness=Randomness(
        kind="reproducible", device=torch.device("cpu"), seed=5), device=torch.device("cpu"))
    releases, noises = [], []
    for t, idx in enumerate(batches):
        if t == resume_at:
            method = restored(method, params=params, schedule=schedule, workload=workload)
        probe = copy.deepcopy(method)
        probe.begin_step(probe.step_count)
        releases.append(check_release(probe, engine=t in engine_steps, crafted=crafted))
        if t in noise_steps:
            noises.append(check_noise(probe))
        method.step(x[idx], y[idx])
    return Lifecycle(releases=releases, noises=noises)


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
