"""Per-example gradient engine: per-layer norms and weighted sums from one forward + backward.

A DP step needs, per example i and layer l, the norm of the example's gradient block and then
sum_i coef[i, l] * g_i for every parameter. ``torch.func.vmap(grad)`` materialises every g_i
(B copies of the model); this engine does not. It is the *book-keeping* scheme of Bu et al.
(2023), "Differentially Private Optimization on Large Model at Small Cost" (arXiv 2210.00038):

* one forward with hooks that keep each module's input ``a``, and one backward of the summed
  per-example cross-entropy that stops at module outputs (parameters are detached for the pass,
  so autograd never computes a parameter gradient; a hook on each module's output tensor
  receives the output gradient ``b``, in-place changes of that output downstream included).
  Examples do not interact (no BatchNorm), so ``b_i`` is the gradient of example i's own loss
  and g_i(W) = a_i^T b_i for a Linear / Conv weight.
* per module, the per-example squared norm of a_i^T b_i, by one of two algorithms:

  - *ghost norm* (Goodfellow 2015, "Efficient Per-Example Gradient Computations", arXiv
    1510.01799; Li et al. 2021, "Large Language Models Can Be Strong Differentially Private
    Learners", arXiv 2110.05679): ||a_i^T b_i||^2 = <a_i a_i^T, b_i b_i^T> over the T positions
    (exact, and free when T = 1). For a convolution the input Gram a_i a_i^T over patches is
    formed without unfolding when that is cheaper (stride 1): the Gram of the padded input's
    positions, summed over the K kernel taps as K strided views (C (HW)^2 + K T^2 work instead
    of C K T^2 plus a K-times larger unfolded copy). The weighted sum is then one native
    weight-gradient kernel on the scaled output gradients, sum_i a_i^T (c_i b_i), the cost of
    the non-private weight gradient.
  - *materialise* a_i^T b_i (T p d work): for Conv2d as one grouped convolution-weight kernel
    with the batch folded into the groups (Rochette et al. 2019, "Efficient Per-Example
    Gradient Computations in Convolutional Neural Networks", arXiv 1912.06015); the per-example
    gradients are *kept* for the weighted sum (one [B] x [B, p d] product) when they are no
    larger than ``KEEP_RATIO`` times the output gradient the ghost path would keep, otherwise
    dropped after their norm and the sum is formed natively as above.

  ``strategy="auto"`` runs per module the fastest candidate as timed on the trial's device
  (``measure_plan``, :mod:`trainables.engine.plan`: ghost, materialised kept or dropped, each
  with the native kernels or, for a convolution, the unfolded patches and batched products
  that run fast on a GPU); where nothing was timed, the cheaper in multiply-adds per example,
  the cost model below, which also breaks near-ties. Mixed ghost
  clipping (Bu et al. 2022, "Scalable and Efficient Training of Large Convolutional Neural
  Networks with Differential Privacy", arXiv 2205.10683) picks by *space* (ghost iff
  2 T^2 < p d); we pick by time and keep the space concern in ``KEEP_RATIO``. With
  wgrad = T p d (the non-private weight gradient; g groups multiply everything)::

      ghost       = gram_a + T^2 p + wgrad   (gram_a: C_g (HW)^2 + K T^2, or d T^2 unfolded)
      materialise = MATERIALIZE_COST * wgrad + (p d if kept else wgrad)

  (on 2 AVX2 cores the grouped kernel costs 0.4-2.7 native weight gradients,
  ``MATERIALIZE_COST`` = 2). The cost model's choices at the benchmark shapes
  (``GradEngine.plan`` prints the plan in force for any model, measured or not, with each
  candidate's time)::

      cnn28 (1x28x28):  conv1 materialise (kept); conv2, fc1, fc2 ghost
      cnn5 (3x32x32):   conv1, conv2 materialise (kept); conv3, fc1, fc2 ghost
      resnet20_gn:      stem and the 32x32 / 16x16 stages materialise (kept); 8x8 stage and
                        fc ghost
      wrn16_4:          stem, 32x32 stage, stage-2 1x1 shortcut materialise (kept); the
                        stride-2 3x3 conv into 16x16 materialise (dropped); other 16x16 and
                        all 8x8 convs, stage-3 shortcut and fc ghost

* ``nn.Conv1d`` runs as a Conv2d of height 1 (the same kernels, costs and choice).
* ``nn.Embedding``: ``a`` is the token ids (one-hot rows of width V), so a_i^T b_i adds each
  output-gradient row b_t into vocabulary row id_t. Ghost norm: the sum over position pairs
  holding the same token of <b_t, b_t'> (T^2 p, no V-sized tensor); materialise: a dense
  V x p block per example; the weighted sum is the native embedding backward (T p). ``auto``
  picks ghost unless T^2 (p + 1) exceeds about 2 V p. Positions holding ``padding_idx`` get no
  gradient, as in PyTorch. ``max_norm`` (rewrites the weight in forward), ``scale_grad_by_freq``
  (each example's gradient depends on the batch's token counts) and ``sparse`` (no
  ``torch.func`` form) are refused at construction, wherever they sit.
* ``nn.GroupNorm`` / ``nn.LayerNorm``: per-example grads of weight and bias are [B, C]-sized
  (sum over positions of b * x_hat, x_hat recomputed from the kept input): always kept.
* ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: run step by step during the pass, with the Linear
  rules on their gate projections (:mod:`trainables.engine.rnn`).
* Any other module that owns parameters (and ``nn.MultiheadAttention`` as a whole) falls back to
  ``torch.func`` for its own parameters: every input and output gradient of each call is kept,
  and per-example gradients come from ``vmap`` over that module alone
  (:mod:`trainables.engine.func`, exact for the same reason). Batch dimensions of hooked
  tensors are found once by probing (same module). A module called more than once per
  forward is materialised and summed over calls (ghost norms do not add up over calls).
* A parameter read outside its own module's forward (Swin v1's attention hands its Linear
  children's weights to ``F.linear``) goes, with everything under the module reading it, to
  that module's ``torch.func`` fallback (:mod:`trainables.engine.reads`): none is left out.

The norm of a layer (block) is the root of the sum of its parameters' squared norms, in float64:
every squared norm is formed from row-scaled factors (each example's block, or its input and
output gradient, divided by its largest magnitude), so float32 blocks of tiny entries, whose
squares would be subnormal or zero, keep their true norm (a rule that divides by the norm would
otherwise overshoot its bound; ``DPStep.bounded`` is the guard behind it). The
returned view's ``weighted_sum`` forms every live parameter's sum without a second backward.
With more than ``max_physical_batch`` examples the batch is processed in chunks; only the last
chunk's state is kept, so memory stays bounded by one chunk, and ``weighted_sum`` recomputes
the earlier chunks' forward + backward (the price of the bound; one chunk costs nothing extra).

Restrictions (checked where cheap): blocks must not mix examples (no BatchNorm); the parameters
must not change between ``compute`` and ``weighted_sum`` when chunks are recomputed.

This module holds the views and the passes; the per-module algebra above (the handlers, the
choice and its constants ``KEEP_RATIO`` and ``MATERIALIZE_COST``, the tap) is in
:mod:`trainables.engine.modules`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.core.poisson import PHYSICAL_BATCH
from dpsweep.trainables.engine.attention import AttentionUnit
from dpsweep.trainables.engine.func import (
    CallDims,
    NotPerExample,
    OwnerFallback,
    leaves,
    probe_calls,
    vmap_examples,
)
from dpsweep.trainables.engine.modules import (
    Choice,
    Geometry,
    Handler,
    combine,
)
from dpsweep.trainables.engine.norms import scaled_sq_norms
from dpsweep.trainables.engine.params import ParamUses, probe_uses, uses_mode
from dpsweep.trainables.engine.passes import (
    PATCHED,
    ChunkState,
    Pass,
    Unit,
    accumulate,
    batch_first,
    build_units,
    replaying,
    rng_state,
    unit_layers,
    unpatch,
)
from dpsweep.trainables.engine.plan import ModuleTiming, measure, plan_key
from dpsweep.trainables.engine.reads import reroute
from dpsweep.trainables.engine.rnn import RecurrentUnit
from dpsweep.trainables.models.trainable import TrainableLayers, trainable_layers

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn

    from dpsweep.trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

STRATEGIES = ("auto", "ghost", "materialize", "vmap")
#: Planning time, in passes of the planning batch (about half a step each): a few steps.
PLAN_PASSES = 10
#: The per-example paths a model can take, as a trial's record states them: the engine's
#: algebra throughout; the engine with ``torch.func`` for layers it has no algebra for (block
#: by block); ``torch.func`` over the whole model (a user model whose unhandled layer takes more
#: than one tensor or runs more than once per forward).
ENGINE_PATH = "engine"
BLOCK_EXACT_PATH = "engine+torch.func blocks"
WHOLE_EXACT_PATH = "torch.func (whole model)"
#: ``seed(logits, y) -> [B, C]``: an output gradient that a pass backpropagates instead of the
#: summed cross-entropy's (``GradEngine.compute(seed=...)``); each example's gradient is linear
#: in its own row. Used by the audit only: training never passes one.
OutputSeed = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


# ---- the gradient view ------------------------------------------------------------------------
class PerExampleView(Protocol):
    """Per-layer per-example norms and coefficient-weighted sums of per-example gradients."""

    norms: torch.Tensor  # [B, L] float64 per-example L2 norm of each layer's block (0: frozen)
    losses: torch.Tensor  # [B] per-example loss, for monitoring only

    def weighted_sum(self, coef: torch.Tensor) -> dict[str, torch.Tensor]:
        """{p: sum_i coef[i, layer(p)] * g_i(p)} for every live parameter p."""
        ...


def _check_coef(coef: torch.Tensor, norms: torch.Tensor) -> None:
    if tuple(coef.shape) != tuple(norms.shape):
        raise ValueError(f"coef has shape {tuple(coef.shape)}; the view needs "
                         f"{tuple(norms.shape)} (examples x layers)")


@dataclass
class MaterializedGrads:
    """Explicit per-example gradients as a view: the reference, and how tests feed adversarial
    gradients to a method."""

    grads: dict[str, torch.Tensor]  # parameter name -> [B, *param.shape]
    norms: torch.Tensor
    losses: torch.Tensor
    layer_of: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_grads(cls, grads: dict[str, torch.Tensor], *, layer_of: dict[str, int],
                   num_layers: int, losses: torch.Tensor | None = None) -> MaterializedGrads:
        """Attach per-layer norms (one pass over the blocks; they come free with the grads)."""
        first = next(iter(grads.values()))
        sq = torch.zeros(first.shape[0], num_layers, device=first.device, dtype=torch.float64)
        for n, g in grads.items():
            sq[:, layer_of[n]] += scaled_sq_norms(g)
        if losses is None:
            losses = torch.zeros(first.shape[0], device=first.device, dtype=first.dtype)
        return cls(grads=grads, norms=sq.sqrt(), losses=losses, layer_of=dict(layer_of))

    def weighted_sum(self, coef: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_coef(coef, self.norms)
        return {n: combine(coef[:, self.layer_of[n]], g) for n, g in self.grads.items()}


class BookkeepingView:
    """The engine's view: norms now, weighted sums from the kept state (or recomputed chunks)."""

    def __init__(self, *, engine: GradEngine, x: torch.Tensor, y: torch.Tensor,
                 live: list[bool], bounds: list[tuple[int, int]],
                 states: list[ChunkState | None], norms: torch.Tensor,
                 losses: torch.Tensor, rngs: list[Any], seed: OutputSeed | None = None) -> None:
        self.norms = norms
        self._seed = seed
        self._rngs = rngs
        self.losses = losses
        self._engine = engine
        self._x, self._y = x, y
        self._live = live
        self._bounds = bounds
        self._states = states
        #: parameter versions at compute(), for a view that must recompute earlier chunks
        self._versions = engine._versions() if len(bounds) > 1 else None

    def weighted_sum(self, coef: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_coef(coef, self.norms)
        engine = self._engine
        total: dict[str, torch.Tensor] = {}
        for (start, stop), state in zip(self._bounds, self._states, strict=True):
            c = coef[start:stop]
            if state is not None:
                part = state.weighted_sum(c, engine.layer_of)
            else:
                if engine._versions() != self._versions:
                    raise RuntimeError("the model's parameters changed after compute(); "
                                       "a chunked view cannot recompute its sums")
                with replaying(self._rngs[start // engine.max_physical_batch], self._x):
                    part = engine._sums(self._x[start:stop], self._y[start:stop], c,
                                        live=self._live, seed=self._seed)
            for n, s in part.items():
                accumulate(total, n, s)
        names = engine.live_parameters(self._live)
        if all(n in total for n in names):
            return {n: total[n] for n in names}
        params = dict(engine.model.named_parameters())
        return {n: total[n] if n in total else torch.zeros_like(params[n]) for n in names}


# ---- the engine -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModulePlan:
    """How the engine treats one module at one input shape (``GradEngine.plan``)."""

    layer: str
    module: str
    kind: str
    geometry: Geometry
    norm: str  # "ghost", "materialize", "per-channel" or "vmap"
    keep: bool
    kernel: str = "native"
    source: str = ""  # "measured", "cache" or "cost model" for a handled module's weight
    timings_ms: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        g = self.geometry
        how = (Choice(self.norm, self.keep, self.kernel).label
               if self.norm in ("ghost", "materialize") else self.norm)
        if self.source:
            how += f" [{self.source}]"
        if self.timings_ms:
            how += " " + ", ".join(f"{k} {v:.3g} ms" for k, v in
                                   sorted(self.timings_ms.items(), key=lambda kv: kv[1]))
        return (f"{self.layer:<8} {self.module:<28} {self.kind:<10} T={g.positions:<5} "
                f"d={g.fan_in:<5} p={g.fan_out:<4} g={g.groups:<2} {how}")


class GradEngine:
    """Per-example norms and weighted sums for a ``LayeredModel``; see the module docstring.

    ``strategy``: "auto" (cheapest algorithm per module), "ghost" or "materialize" (forced on
    every module the engine has algebra for), "vmap" (``torch.func`` over the whole model, the
    reference).
    """

    def __init__(self, model: LayeredModel | TrainableLayers, *, strategy: str = "auto",
                 max_physical_batch: int = PHYSICAL_BATCH) -> None:
        if strategy not in STRATEGIES:
            raise UserInputError(field="strategy", value=strategy, allowed=f"one of {STRATEGIES}")
        if isinstance(max_physical_batch, bool) or not isinstance(max_physical_batch, int) \
                or max_physical_batch < 1:
            raise UserInputError(field="max_physical_batch", value=max_physical_batch,
                                 allowed="a positive integer")
        self.model = trainable_layers(model)
        #: A user model whose modules cannot be followed example by example
        #: (``trainables.models.validator``) takes the exact path over the whole model.
        whole = self.model.per_example_path == WHOLE_EXACT_PATH
        self.strategy = "vmap" if whole else strategy
        self.max_physical_batch = max_physical_batch
        self.layer_names = self.model.layer_names
        self.num_layers = len(self.layer_names)
        self.layer_of = self.model.layer_of_parameter()
        self._units = build_units(self.model.named_modules(), self.layer_of)
        self._probed = False
        #: the measured plan (``measure_plan``): (module, geometry) -> choice, and its record
        self._measured: dict[tuple[str, Geometry], ModuleTiming] = {}

    # -- introspection
    @property
    def path(self) -> str:
        """Which per-example path this engine takes (``ENGINE_PATH`` and the two exact ones)."""
        if self.strategy == "vmap":
            return WHOLE_EXACT_PATH
        if any(isinstance(u, OwnerFallback) for u in self._units):
            return BLOCK_EXACT_PATH
        return ENGINE_PATH

    def choice(self, handler: Handler, geometry: Geometry) -> Choice:
        """How ``handler``'s weight is normed and summed at ``geometry``: the measured plan's
        choice, else the cost model's (always under a forced strategy)."""
        if self.strategy == "auto":
            timed = self._measured.get((handler.qualname, geometry))
            if timed is not None:
                return timed.choice
        return handler.cost_choice(geometry, strategy=self.strategy)

    @property
    def timings(self) -> list[ModuleTiming]:
        """The measured plan, module by module (empty before ``measure_plan``)."""
        return list(self._measured.values())

    def measure_plan(self, x: torch.Tensor, y: torch.Tensor, *, live: Sequence[bool],
                     cache: Path | None = None) -> list[ModuleTiming]:
        """Time every candidate of every handled module on one chunk of ``x`` (public data:
        the plan must not depend on private examples) and keep the fastest
        (:mod:`trainables.engine.plan`); ``cache``: the run's cache folder. A no-op under a
        forced strategy or on the whole-model exact path."""
        if self.strategy != "auto" or x.shape[0] == 0:
            return []
        x, y = x[:self.max_physical_batch], y[:self.max_physical_batch]
        self.probe(x)
        started = time.perf_counter()
        p, _ = self._run(x, y, live=[bool(v) for v in live], coef=None, capture=True)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        budget = PLAN_PASSES * (time.perf_counter() - started)
        captured = (p.capture or [])[::-1]  # caught in backward order: forward order
        key = plan_key(device=x.device, dtype=self._dtype(), rows=x.shape[0],
                       captured=captured)
        found = measure(captured, strategy=self.strategy, cache=cache, key=key,
                        budget_s=budget)
        self._measured = {(t.module, t.geometry): t for t in found}
        return found

    def live_parameters(self, live: Sequence[bool]) -> list[str]:
        return [n for n, _ in self.model.named_parameters() if live[self.layer_of[n]]]

    def _versions(self) -> list[int]:
        return [p._version for p in self.model.parameters()]

    def call_dims(self, unit: Handler | OwnerFallback, call: int) -> CallDims:
        """Batch dimensions of ``unit``'s ``call``-th call in a forward (probed once)."""
        calls = getattr(unit, "dims", [])
        if call >= len(calls):
            raise NotPerExample(f"{unit.qualname or 'the model'} ran more often than in the "
                                "probe forward (a data-dependent number of calls)")
        return calls[call]

    def probe(self, x: torch.Tensor) -> None:
        """Find every hooked module's batch dimensions (``trainables.engine.func``), once,
        after parameters read outside their module go to their reader (``engine.reads``)."""
        if self._probed or self.strategy == "vmap":
            return
        self._units = reroute(self._units, model=self.model, x=x, layer_of=self.layer_of)
        try:
            probe_uses([u for u in self._units if isinstance(u, ParamUses)], self.model.model, x)
        except NotPerExample:  # a parameter transformed on its own before it meets the batch
            self._units = [OwnerFallback(u.module, qualname=u.qualname, params=u.local,
                                         layer_of=self.layer_of)
                           if isinstance(u, ParamUses) else u for u in self._units]
        probed = [u for u in self._units if isinstance(u, Handler | OwnerFallback)]
        modules = {i: u.module for i, u in enumerate(probed)}
        names = {i: u.qualname or "the model" for i, u in enumerate(probed)}
        found = probe_calls(self.model.model, x, modules, names)
        for i, u in enumerate(probed):  # on the unit: a deep copy of the engine keeps them
            u.dims = found[i]
        self._probed = True

    def plan(self, sample: torch.Tensor) -> list[ModulePlan]:
        """Each module's algorithm for inputs shaped like ``sample`` (one forward, no grads)."""
        self.probe(sample)
        seen: list[ModulePlan] = []
        counts: dict[int, int] = {}

        def record(unit: Unit) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     output: Any) -> None:
                del module
                call = counts.get(id(unit), 0)
                counts[id(unit)] = call + 1
                if call:
                    return
                layer = self.layer_names[unit_layers(unit)[0]]
                if not isinstance(unit, Handler):
                    how = {OwnerFallback: "vmap", ParamUses: "per use",
                           RecurrentUnit: "Linear rules per step",
                           AttentionUnit: "Linear rules on projections"}[type(unit)]
                    seen.append(ModulePlan(layer=layer, module=unit.qualname or "(model)",
                                           kind=unit.kind, geometry=Geometry(1, 1, 1),
                                           norm=how, keep=True))
                    return
                flat, _ = leaves((args, kwargs))
                first = next(i for i, v in enumerate(flat) if isinstance(v, torch.Tensor))
                # the whole-model path needs no batch dimensions: its plan assumes them first
                dims = (self.call_dims(unit, 0) if self.strategy != "vmap"
                        else CallDims(inputs=(0,) * len(flat), outputs=(0,)))
                a = unit.prepare(batch_first(flat[first], dims.inputs[first], unit))
                geometry = unit.geometry(a, batch_first(output, dims.outputs[0], unit))
                if unit.per_channel or self.strategy == "vmap":
                    how = "per-channel" if unit.per_channel else "vmap"
                    seen.append(ModulePlan(layer=layer, module=unit.qualname, kind=unit.kind,
                                           geometry=geometry, norm=how, keep=True))
                    return
                choice = self.choice(unit, geometry)
                timed = self._measured.get((unit.qualname, geometry))
                seen.append(ModulePlan(
                    layer=layer, module=unit.qualname, kind=unit.kind, geometry=geometry,
                    norm=choice.norm, keep=choice.keep, kernel=choice.kernel,
                    source="cost model" if timed is None else timed.source,
                    timings_ms={} if timed is None else dict(timed.timings_ms)))
            return hook

        handles = [u.module.register_forward_hook(record(u), with_kwargs=True)
                   for u in self._units]
        try:
            with torch.no_grad():
                self.model(sample[:1])
        finally:
            for h in handles:
                h.remove()
        return seen

    # -- computation
    def compute(self, x: torch.Tensor, y: torch.Tensor, *, live: Sequence[bool],
                seed: OutputSeed | None = None) -> PerExampleView:
        """Per-layer norms of the per-example gradients of the live layers, and their sums.

        ``seed`` (opt-in, not on the whole-model exact path): the gradients are those of
        ``(logits * seed(logits, y)).sum()`` instead of the summed cross-entropy, so the audit
        can backpropagate an exactly computed, rescaled output residual (the losses returned
        stay the cross-entropy's)."""
        live = [bool(v) for v in live]
        if len(live) != self.num_layers:
            raise UserInputError(field="live", value=len(live),
                                 allowed=f"one flag per layer ({self.num_layers})")
        if self.strategy == "vmap":
            if seed is not None:
                raise UserInputError(field="seed", value="an output seed",
                                     allowed="none on the whole-model torch.func path")
            return self._vmap(x, y, live)
        if x.shape[0]:
            self.probe(x)
        n = x.shape[0]
        bounds = [(s, min(n, s + self.max_physical_batch))
                  for s in range(0, n, self.max_physical_batch)]
        norms, losses = [], []
        states: list[ChunkState | None] = []
        rngs: list[Any] = []  # generator states at each chunk's start, to recompute it
        for start, stop in bounds:
            if states:
                states[-1] = None  # memory bounded by one chunk: earlier ones are recomputed
            rngs.append(rng_state(x))
            state, chunk_norms, chunk_losses = self._norms(x[start:stop], y[start:stop],
                                                           live=live, seed=seed)
            norms.append(chunk_norms)
            losses.append(chunk_losses)
            states.append(state)
            del state  # the list holds the only reference, so the next chunk can free it
        if not bounds:
            norms = [torch.zeros(0, self.num_layers, dtype=torch.float64, device=x.device)]
            losses = [torch.zeros(0, dtype=self._dtype(), device=x.device)]
        return BookkeepingView(engine=self, x=x, y=y, live=live, bounds=bounds, states=states,
                               norms=torch.cat(norms), losses=torch.cat(losses), rngs=rngs,
                               seed=seed)

    def _dtype(self) -> torch.dtype:
        first = next(self.model.parameters(), None)
        return torch.get_default_dtype() if first is None else first.dtype

    def _norms(self, x: torch.Tensor, y: torch.Tensor, *, live: list[bool],
               seed: OutputSeed | None = None) -> tuple[ChunkState, torch.Tensor, torch.Tensor]:
        p, losses = self._run(x, y, live=live, coef=None, seed=seed)
        state = ChunkState(kept=p.kept, pending=p.pending, rows=p.rows)
        return state, p.sq.clamp_min(0).sqrt(), losses

    def _sums(self, x: torch.Tensor, y: torch.Tensor, coef: torch.Tensor, *,
              live: list[bool], seed: OutputSeed | None = None) -> dict[str, torch.Tensor]:
        p, _ = self._run(x, y, live=live, coef=coef, seed=seed)
        return p.sums

    def _run(self, x: torch.Tensor, y: torch.Tensor, *, live: list[bool],
             coef: torch.Tensor | None, capture: bool = False,
             seed: OutputSeed | None = None) -> tuple[Pass, torch.Tensor]:
        """One forward + backward of the summed per-example loss (or of ``seed``'s surrogate,
        ``compute``) over one chunk (``capture``: keep every handled module's input and output
        gradient, for ``measure_plan``)."""
        p = Pass(self, x.shape[0], live=live, dtype=self._dtype(), device=x.device, coef=coef)
        p.capture = [] if capture else None
        params = list(self.model.parameters())
        saved = [q.requires_grad for q in params]
        active = [u for u in self._units if any(live[i] for i in unit_layers(u))]
        handles = [u.module.register_forward_hook(p.hook(u), with_kwargs=True)
                   for u in active if isinstance(u, Handler | OwnerFallback)]
        uses = [u for u in active if isinstance(u, ParamUses)]
        for u in active:
            if isinstance(u, PATCHED):  # an instance attribute shadows the class's
                u.module.forward = functools.partial(u.forward, p.part_tap)
        try:
            for q in params:
                q.requires_grad_(False)
            with torch.enable_grad():
                with (uses_mode(uses, p.on_use, model=self.model.model) if uses
                      else contextlib.nullcontext()):
                    logits = self.model(x)
                losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
                for h in handles:
                    h.remove()
                if losses.requires_grad and seed is None:
                    torch.autograd.grad(losses.sum(), [p.anchor], allow_unused=True)
                elif losses.requires_grad:
                    torch.autograd.grad(logits, [p.anchor], allow_unused=True,
                                        grad_outputs=seed(logits.detach(), y).to(logits.dtype))
            unpatch(active)  # a fallback's own forward, below, runs the modules as they are
            with torch.no_grad():
                p.finish()
        finally:
            for h in handles:
                h.remove()
            unpatch(active)
            for q, s in zip(params, saved, strict=True):
                q.requires_grad_(s)
        return p, losses.detach()

    def _vmap(self, x: torch.Tensor, y: torch.Tensor, live: list[bool]) -> MaterializedGrads:
        """The reference path: vmap of grad of the per-example loss over the whole model
        (frozen parameters and those of layers not live held fixed)."""
        functional_call, grad_and_value = torch.func.functional_call, torch.func.grad_and_value

        model = self.model.model
        trainable = {n: q.detach() for n, q in model.named_parameters()
                     if n in self.layer_of and live[self.layer_of[n]]}
        fixed = {n: q.detach() for n, q in model.named_parameters() if n not in trainable}

        def loss_one(tp: dict[str, torch.Tensor], xi: torch.Tensor,
                     yi: torch.Tensor) -> torch.Tensor:
            out = functional_call(model, {**tp, **fixed}, (xi.unsqueeze(0),))
            return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))

        n = x.shape[0]
        if not trainable or n == 0:
            with torch.no_grad():
                losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none") \
                    if n else torch.zeros(0, dtype=self._dtype(), device=x.device)
            sq = torch.zeros(n, self.num_layers, dtype=torch.float64, device=x.device)
            grads = {k: torch.zeros(n, *v.shape, dtype=v.dtype, device=v.device)
                     for k, v in trainable.items()}
            return MaterializedGrads(grads=grads, norms=sq, losses=losses,
                                     layer_of=dict(self.layer_of))
        chunk = self.max_physical_batch if n > self.max_physical_batch else None
        grads, losses = vmap_examples(grad_and_value(loss_one), in_dims=(None, 0, 0),
                                      chunk=chunk)(trainable, x, y)
        return MaterializedGrads.from_grads(grads, layer_of=self.layer_of,
                                            num_layers=self.num_layers, losses=losses.detach())
