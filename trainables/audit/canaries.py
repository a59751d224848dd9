"""Canaries for the one-run audit: white-box gradient canaries and black-box input canaries.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (arXiv 2305.08846):
m canaries are each included independently with probability 1/2 in ONE training run, the
trained run is scored per canary, and the number of correct IN/OUT guesses becomes an epsilon
lower bound (``reports.audit_stats.canary_audit``; the theorem lives there only). This module
produces the scores and the secret membership; it never changes the method under audit: the
canaries enter through :func:`trainables.training.train_trial`'s ``instrument`` hook, which
wraps the built method's phases, so the method's own clipping, reweighting, noise and
accounting act on them exactly as on its examples.

* **White-box** (the paper's strongest variant, "Dirac canaries"): canary j is a gradient whose
  whole norm, ``CANARY_NORM_FACTOR`` x C, sits on one coordinate of a live layer's parameter
  (m distinct coordinates drawn from the audit seed: public, as the auditor must know them).
  Each step, every IN canary joins the batch independently with the trial's sample rate q,
  like an example: its block is appended to the per-example gradient view *before* clipping
  (:class:`CanaryView`). Its score is the sum over steps of the released noisy gradient's
  coordinate (the noise phase's output, which the update reveals).
* **Black-box**: m examples of the holdout split (disjoint from train, validation, test and the
  public shadow pool; the trial itself never trains on it) with labels replaced by random wrong
  labels, the least typical inputs there are. Each IN canary joins each step's Poisson batch
  with the trial's rate q, exactly like a training example; the score is minus its loss under
  the final model. The canaries join the batches rather than the training set so that the
  trial's calibration (q, steps, sigma) is reused unchanged: recalibrating for N + |IN| would
  make q depend on how many canaries are IN, i.e. on the secret, and Poisson-subsampled DP at a
  fixed q does not depend on N. (The update still divides by the trial's q N, a public constant;
  the IN canaries make batches about m / (2N) larger on average.)

The IN/OUT draws come from the operating system's entropy pool (:func:`draw_membership`), never
from a seed that is written anywhere, and the canaries' per-step sampling from a secret
:class:`~trainables.randomness.Randomness` of their own (``secure`` when the trial is).

White-box caveats: a step whose private batch is empty takes the base step's no-gradient path,
so IN canaries sampled in it are dropped (counted in ``dropped_joins``; probability e^(-qN) per
step), and so is a canary whose layer a method has frozen at that step. Dropping only lowers
each canary's inclusion probability independently of the data, so the audited mechanism stays
within the claim and the bound stays sound.
"""

from __future__ import annotations

import functools
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import UserInputError
from core.lazy import lazy_module
from reports.audit_stats import DEFAULT_CONFIDENCE, canary_audit, default_guess_counts
from reports.audit_stats import CanaryAudit as CanaryBound

if TYPE_CHECKING:
    import torch

    from trainables.data import DataSplits
    from trainables.dp_step import DPStep
    from trainables.models import LayeredModel
    from trainables.randomness import Randomness
    from trainables.training import Reporter, TrialSpec
else:
    torch = lazy_module("torch")

WHITE_BOX = "white-box"
BLACK_BOX = "black-box"
KINDS = (WHITE_BOX, BLACK_BOX)
#: A white-box canary's gradient norm in units of the method's clipping norm C: far above C,
#: so every clipping or normalising rule saturates on it, yet small enough that an unclipped
#: canary moves its weight by lr x 100 C / (q N) per step, not by floating-point overflow.
CANARY_NORM_FACTOR = 100.0
#: Separates the audit seed's streams (coordinates, pool picks, wrong labels) from other uses.
_COORDINATE_STREAM = 0xCA11
_POOL_STREAM = 0xCA12
#: Where black-box canaries come from: the split no part of the trial trains on.
CANARY_POOL = "holdout"


def _check_count(m: Any, *, limit: int, what: str) -> int:
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= limit:
        raise UserInputError(field="canaries", value=m, allowed=f"an integer in 1..{limit} "
                                                                 f"({what})")
    return int(m)


def draw_membership(m: int) -> np.ndarray:
    """IN (True) or OUT for each of m canaries, each with probability 1/2, from ``os.urandom``.

    The draws are the secret the audit tests, so they are never derived from a seed: anything
    seeded from a recorded value could be replayed by the guesser.
    """
    m = _check_count(m, limit=1 << 24, what="canaries to draw")
    raw = np.frombuffer(secrets.token_bytes((m + 7) // 8), dtype=np.uint8)
    return np.unpackbits(raw)[:m].astype(bool)


def canary_sampler(spec: TrialSpec) -> Randomness:
    """The canaries' per-step Poisson source: secret entropy (``secure`` for secure trials),
    separate from the trial's own sampler so that a reproducible trial's seed never decides
    when a canary joins."""
    from trainables.randomness import Randomness

    kind = "secure" if spec.randomness == "secure" else "secret"
    return Randomness(kind=kind, device=torch.device("cpu"))


# ---- white-box: Dirac gradient canaries --------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DiracCanaries:
    """m gradient canaries, canary j = ``magnitude`` x e_(names[j], index[j]) (public design)."""

    names: tuple[str, ...]  # parameter of each canary's coordinate
    index: tuple[int, ...]  # flat index of the coordinate in that parameter
    layer: tuple[int, ...]  # layer owning the parameter
    magnitude: float
    num_layers: int

    @property
    def m(self) -> int:
        return len(self.names)

    @functools.cached_property
    def _layer(self) -> torch.Tensor:
        return torch.tensor(self.layer, dtype=torch.long)

    @functools.cached_property
    def _groups(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """parameter -> (canary ids on it, their flat indices), for vectorised reads."""
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for j, (name, idx) in enumerate(zip(self.names, self.index, strict=True)):
            ids, flat = groups.setdefault(name, ([], []))
            ids.append(j)
            flat.append(idx)
        return {n: (torch.tensor(ids, dtype=torch.long), torch.tensor(flat, dtype=torch.long))
                for n, (ids, flat) in groups.items()}

    def norms(self, ids: torch.Tensor, *, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """[k, L] per-layer norms of canaries ``ids``: the magnitude in the canary's layer."""
        out = torch.zeros(len(ids), self.num_layers, dtype=dtype, device=device)
        if len(ids):
            out[torch.arange(len(ids), device=device),
                self._layer[ids].to(device)] = self.magnitude
        return out

    def add_weighted(self, sums: dict[str, torch.Tensor], ids: torch.Tensor,
                     coef: torch.Tensor) -> dict[str, torch.Tensor]:
        """``sums`` plus sum_i coef[i, layer(c_i)] x canary c_i, for canaries c = ``ids``."""
        if not len(ids):
            return sums
        layer = self._layer[ids].to(coef.device)
        weights = coef[torch.arange(len(ids), device=coef.device), layer] * self.magnitude
        out = dict(sums)
        names = [self.names[int(j)] for j in ids]
        for name in dict.fromkeys(names):
            if name not in out:  # the parameter is frozen at this step: no gradient at all
                continue
            rows = [i for i, n in enumerate(names) if n == name]
            flat = torch.tensor([self.index[int(ids[i])] for i in rows], dtype=torch.long,
                                device=out[name].device)
            vals = weights[rows].to(device=out[name].device, dtype=out[name].dtype)
            target = out[name].reshape(-1).clone()
            target.index_add_(0, flat, vals)
            out[name] = target.view_as(sums[name])
        return out

    def read(self, released: Mapping[str, torch.Tensor]) -> np.ndarray:
        """[m] each canary's coordinate of a released gradient (0 where it released none)."""
        out = np.zeros(self.m)
        for name, (ids, flat) in self._groups.items():
            value = released.get(name)
            if value is not None:
                picked = value.detach().reshape(-1)[flat.to(value.device)]
                out[ids.numpy()] = picked.double().cpu().numpy()
        return out

    def layer_counts(self) -> list[int]:
        return np.bincount(np.asarray(self.layer, dtype=int), minlength=self.num_layers).tolist()

    def to_dict(self) -> dict[str, Any]:
        return {"m": self.m, "magnitude": self.magnitude, "num_layers": self.num_layers,
                "per_layer": self.layer_counts(), "names": list(self.names),
                "index": list(self.index)}


def choose_dirac_canaries(*, model: LayeredModel, m: int, live: Sequence[bool],
                          magnitude: float, seed: int) -> DiracCanaries:
    """m distinct coordinates drawn uniformly from the live layers' parameters (seeded: the
    auditor knows where the canaries are; only whether each one is IN is secret)."""
    layer_of = model.layer_of_parameter()
    params = [(n, p.numel()) for n, p in model.named_parameters() if live[layer_of[n]]]
    total = sum(k for _, k in params)
    m = _check_count(m, limit=total, what="distinct coordinates of the live layers")
    rng = np.random.default_rng([int(seed), _COORDINATE_STREAM])
    picks = np.sort(rng.choice(total, size=m, replace=False))
    rng.shuffle(picks)  # canary ids carry no order of their coordinates
    ends = np.cumsum([k for _, k in params])
    which = np.searchsorted(ends, picks, side="right")
    starts = ends - np.asarray([k for _, k in params])
    names = tuple(params[i][0] for i in which)
    return DiracCanaries(names=names, index=tuple(int(v) for v in picks - starts[which]),
                         layer=tuple(layer_of[n] for n in names), magnitude=float(magnitude),
                         num_layers=len(model.layer_names))


class CanaryView:
    """A gradient view with canary examples appended after the batch's examples.

    ``norms`` is [B + k, L] (the batch's rows, then the k joining canaries'), and
    ``weighted_sum(coef)`` with a [B + k, L] ``coef`` is the base view's sum over the first B
    rows plus each canary's coordinate scaled by its coefficient: what concatenating the
    canaries' explicit gradients to the batch would give, without materialising them.
    ``losses`` stay the batch's (monitoring only; a canary has no loss).
    """

    def __init__(self, base: Any, canaries: DiracCanaries, ids: torch.Tensor) -> None:
        self.base = base
        self.canaries = canaries
        self.ids = ids
        self.batch = int(base.norms.shape[0])
        extra = canaries.norms(ids, dtype=base.norms.dtype, device=base.norms.device)
        self.norms = torch.cat([base.norms, extra])
        self.losses = base.losses

    def weighted_sum(self, coef: torch.Tensor) -> dict[str, torch.Tensor]:
        if tuple(coef.shape) != tuple(self.norms.shape):
            raise ValueError(f"coef has shape {tuple(coef.shape)}; the view needs "
                             f"{tuple(self.norms.shape)} (examples + canaries x layers)")
        sums = self.base.weighted_sum(coef[:self.batch])
        return self.canaries.add_weighted(sums, self.ids, coef[self.batch:])


@dataclass
class _Counts:
    steps: int = 0
    joins: int = 0  # IN-canary inclusions that reached a gradient view
    dropped: int = 0  # sampled but dropped: empty private batch, or the canary's layer frozen


class WhiteBoxInstrument:
    """``train_trial(instrument=...)``: Dirac canaries in the gradient view, scores from the
    noise phase's output. ``is_member`` is the secret IN/OUT vector."""

    def __init__(self, *, m: int, seed: int, is_member: np.ndarray, sampler: Randomness,
                 norm_factor: float = CANARY_NORM_FACTOR) -> None:
        self.m = int(m)
        self.seed = int(seed)
        self.is_member = np.asarray(is_member, dtype=bool)
        if self.is_member.shape != (self.m,):
            raise ValueError(f"is_member has shape {self.is_member.shape}, expected ({m},)")
        self.sampler = sampler
        self.norm_factor = float(norm_factor)
        self.canaries: DiracCanaries | None = None
        self.scores = np.zeros(self.m)
        self.counts = _Counts()

    def __call__(self, method: DPStep) -> None:
        canaries = choose_dirac_canaries(
            model=method.model, m=self.m, live=method.trainable_layers(),
            magnitude=self.norm_factor * method.clip_norm, seed=self.seed)
        self.canaries = canaries
        in_ids = torch.from_numpy(np.flatnonzero(self.is_member)).long()
        rate = method.ledger.sample_rate
        step, gradients, noise = method.step, method.gradients, method.noise
        pending: dict[str, Any] = {}

        def canary_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            joining = in_ids[self.sampler.poisson_mask(len(in_ids), rate=rate)]
            pending.update(x=x, ids=joining, releasing=True)
            try:
                return step(x, y)
            finally:
                if pending.get("ids") is not None:  # the step never asked for this batch's view
                    self.counts.dropped += len(pending["ids"])
                pending.clear()
                self.counts.steps += 1

        def canary_gradients(x: torch.Tensor, y: torch.Tensor) -> Any:
            view = gradients(x, y)
            if pending.get("ids") is None or x is not pending.get("x"):
                return view  # a public batch (e.g. LM-DP-SGD's u), not the private one
            ids = pending["ids"]
            pending["ids"] = None
            live = method.trainable_layers()
            keep = torch.tensor([live[canaries.layer[int(j)]] for j in ids], dtype=torch.bool)
            self.counts.joins += int(keep.sum())
            self.counts.dropped += int((~keep).sum())
            return CanaryView(view, canaries, ids[keep])

        def canary_noise(summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            released = noise(summed)
            if pending.get("releasing"):
                self.scores += canaries.read(released)
            return released

        method.step = canary_step  # type: ignore[method-assign]
        method.gradients = canary_gradients  # type: ignore[method-assign]
        method.noise = canary_noise  # type: ignore[method-assign]


# ---- black-box: mislabelled input canaries -----------------------------------------------------
@dataclass(frozen=True, eq=False)
class InputCanaries:
    """m mislabelled examples from the holdout split (public design: inputs and labels)."""

    x: torch.Tensor
    y: torch.Tensor  # the wrong labels the canaries carry
    true_y: torch.Tensor
    pool_indices: np.ndarray  # indices in the dataset's pooled example list

    @property
    def m(self) -> int:
        return len(self.y)

    def to_dict(self) -> dict[str, Any]:
        return {"m": self.m, "pool": CANARY_POOL, "pool_indices": self.pool_indices.tolist(),
                "labels": self.y.tolist(), "true_labels": self.true_y.tolist()}


def choose_input_canaries(data: DataSplits, *, m: int, seed: int) -> InputCanaries:
    """m holdout examples with uniformly random wrong labels (seeded from the audit seed)."""
    pool = getattr(data, CANARY_POOL)
    m = _check_count(m, limit=len(pool), what=f"examples in the {CANARY_POOL} split, the pool "
                                              "black-box canaries come from")
    used = np.concatenate([data.train.indices, data.validation.indices, data.test.indices,
                           data.shadow.indices])
    rng = np.random.default_rng([int(seed), _POOL_STREAM])
    pick = np.sort(rng.choice(len(pool), size=m, replace=False))
    indices = np.asarray(pool.indices)[pick]
    if np.intersect1d(indices, used).size:
        raise RuntimeError(f"the {CANARY_POOL} split overlaps the trial's other splits")
    true_y = pool.y[torch.from_numpy(pick)]
    shift = torch.from_numpy(rng.integers(1, data.num_classes, size=m)).to(true_y.dtype)
    return InputCanaries(x=pool.x[torch.from_numpy(pick)], y=(true_y + shift) % data.num_classes,
                         true_y=true_y, pool_indices=indices)


class BlackBoxInstrument:
    """``train_trial(instrument=...)``: each IN canary joins each Poisson batch with rate q."""

    def __init__(self, *, canaries: InputCanaries, is_member: np.ndarray,
                 sampler: Randomness) -> None:
        self.canaries = canaries
        self.is_member = np.asarray(is_member, dtype=bool)
        if self.is_member.shape != (canaries.m,):
            raise ValueError(f"is_member has shape {self.is_member.shape}, "
                             f"expected ({canaries.m},)")
        self.sampler = sampler
        self.counts = _Counts()
        self.method: DPStep | None = None

    def __call__(self, method: DPStep) -> None:
        self.method = method
        device = next(method.model.parameters()).device
        members = torch.from_numpy(self.is_member)
        x_in = self.canaries.x[members].to(device)
        y_in = self.canaries.y[members].to(device)
        rate = method.ledger.sample_rate
        step = method.step

        def canary_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            joining = self.sampler.poisson_mask(len(y_in), rate=rate).to(device)
            self.counts.steps += 1
            self.counts.joins += int(joining.sum())
            losses = step(torch.cat([x, x_in[joining]]), torch.cat([y, y_in[joining]]))
            return losses[:x.shape[0]]

        method.step = canary_step  # type: ignore[method-assign]

    @torch.no_grad()
    def scores(self) -> np.ndarray:
        """Minus each canary's loss (with its wrong label) under the trained model."""
        if self.method is None:
            raise RuntimeError("the instrument was never installed (train_trial did not run)")
        model = self.method.model
        model.eval()
        device = next(model.parameters()).device
        logits = model(self.canaries.x.to(device))
        loss = torch.nn.functional.cross_entropy(logits, self.canaries.y.to(device),
                                                 reduction="none")
        return -loss.double().cpu().numpy()


# ---- one audited training run ------------------------------------------------------------------
def guess_counts(*, m: int) -> tuple[tuple[int, int], ...]:
    """(k_plus, k_minus) candidates: the paper's symmetric guesses (k IN, k OUT) and IN-only
    guesses (k, 0) at the same k.

    Why IN-only too: an IN canary never sampled (probability (1 - q)^T) scores like an OUT one,
    and a leak confined to part of the model (one unclipped layer) lifts only the canaries
    there, so the top of the ranking can be far more reliable than its bottom. The union bound
    over the longer list costs little (each candidate at 1 - 0.05 / 12 instead of 1 - 0.05 / 6).
    """
    symmetric = default_guess_counts(m=m)
    return tuple(dict.fromkeys([*symmetric, *((k, 0) for k, _ in symmetric)]))


@dataclass(frozen=True)
class CanaryRun:
    """One training run with canaries: the scores, the secret membership, and the claim."""

    kind: str
    m: int
    scores: tuple[float, ...]
    is_member: tuple[bool, ...]
    delta: float
    claimed_epsilon: float  # the accountant's upper bound for the run (same calibration)
    dp_valid: bool
    steps: int
    joins: int
    dropped_joins: int
    test_accuracy: float
    seconds: float
    design: dict[str, Any] = field(default_factory=dict)  # where the canaries are (public)

    def bound(self, *, confidence: float = DEFAULT_CONFIDENCE) -> CanaryBound:
        """The epsilon lower bound at ``confidence`` (``reports.audit_stats.canary_audit``)."""
        return canary_audit(scores=np.asarray(self.scores), is_member=np.asarray(self.is_member),
                            delta=self.delta, confidence=confidence,
                            guess_counts=guess_counts(m=self.m))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "m": self.m, "delta": self.delta,
                "claimed_epsilon": self.claimed_epsilon, "dp_valid": self.dp_valid,
                "steps": self.steps, "joins": self.joins, "dropped_joins": self.dropped_joins,
                "in_canaries": int(sum(self.is_member)), "test_accuracy": self.test_accuracy,
                "seconds": self.seconds, "design": self.design,
                "scores": [s if math.isfinite(s) else None for s in self.scores],
                "is_member": [bool(b) for b in self.is_member]}


def _finish(*, kind: str, spec: TrialSpec, result: Any, scores: np.ndarray,
            is_member: np.ndarray, counts: _Counts, design: dict[str, Any],
            start: float) -> CanaryRun:
    cal = spec.calibration
    return CanaryRun(kind=kind, m=len(scores), scores=tuple(float(s) for s in scores),
                     is_member=tuple(bool(b) for b in is_member), delta=float(cal["delta"]),
                     claimed_epsilon=float(result.privacy["epsilon_upper"]),
                     dp_valid=bool(result.privacy["dp_valid"]), steps=counts.steps,
                     joins=counts.joins, dropped_joins=counts.dropped,
                     test_accuracy=float(result.test_accuracy),
                     seconds=time.perf_counter() - start, design=design)


def white_box_run(spec: TrialSpec, *, m: int, seed: int, data: DataSplits | None = None,
                  report: Reporter | None = None,
                  on_install: Callable[[WhiteBoxInstrument], None] | None = None) -> CanaryRun:
    """Re-train ``spec`` once with m Dirac gradient canaries; score them (module docstring)."""
    from trainables.training import train_trial

    start = time.perf_counter()
    is_member = draw_membership(m)
    inst = WhiteBoxInstrument(m=m, seed=seed, is_member=is_member, sampler=canary_sampler(spec))

    def install(method: DPStep) -> None:
        inst(method)
        if on_install is not None:
            on_install(inst)

    result = train_trial(spec, data=data, report=report, instrument=install)
    assert inst.canaries is not None
    return _finish(kind=WHITE_BOX, spec=spec, result=result, scores=inst.scores,
                   is_member=is_member, counts=inst.counts, design=inst.canaries.to_dict(),
                   start=start)


def black_box_run(spec: TrialSpec, *, m: int, seed: int, data: DataSplits | None = None,
                  report: Reporter | None = None) -> CanaryRun:
    """Re-train ``spec`` once with m mislabelled holdout canaries; score them by -loss."""
    from trainables.training import load_trial_data, train_trial

    start = time.perf_counter()
    data = load_trial_data(spec) if data is None else data
    canaries = choose_input_canaries(data, m=m, seed=seed)
    is_member = draw_membership(canaries.m)
    inst = BlackBoxInstrument(canaries=canaries, is_member=is_member,
                              sampler=canary_sampler(spec))
    result = train_trial(spec, data=data, report=report, instrument=inst)
    return _finish(kind=BLACK_BOX, spec=spec, result=result, scores=inst.scores(),
                   is_member=is_member, counts=inst.counts, design=canaries.to_dict(),
                   start=start)
