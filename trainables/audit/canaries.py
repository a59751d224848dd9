"""Canaries for the one-run audit: white-box gradient canaries and black-box input canaries.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (arXiv 2305.08846):
m canaries are each included independently with probability 1/2 in ONE training run, the
trained run is scored per canary, and the number of correct IN/OUT guesses becomes an epsilon
lower bound (``trainables.audit.stats.onerun.canary_audit``; the theorem lives there only).
This module and :mod:`trainables.audit.input_canaries` (the black-box kind) produce the scores
and the secret membership, and :mod:`trainables.audit.canary_runs` runs the audited training;
none of them changes the method under audit: the canaries enter through
:func:`trainables.training.loop.train_trial`'s ``instrument`` hook, which wraps the built
method's phases, so the method's own clipping, reweighting, noise and accounting act on them
exactly as on its examples.

* **White-box** (gradient canaries, the paper's strongest variant, spread over the layers):
  canary j is a gradient with one signed coordinate in *every* layer, of norm ``blocks[l]``
  there (:func:`layer_blocks`: ``CANARY_NORM_FACTOR`` x C in all, far above any threshold).
  Each step, every IN canary joins the batch independently with the trial's sample rate q, like
  an example: its row is appended to the per-example gradient view *before* clipping
  (:class:`CanaryView`), so the method's own rule decides what it contributes to each layer:
  C / sqrt(L)-like shares under flat clipping, C_i w_l under LM-DP-SGD, C_l under DP-AdamILG.
  A canary on one coordinate of one layer (a Dirac canary) would see only that layer's share of
  a per-layer method's budget (at epsilon 3 on digits its bound was 0.17 for DP-AdamILG against
  0.82 for DP-SGD); spread like this, it sees all of it. The score is the likelihood-ratio test
  for Gaussian noise: per layer, the sum over steps of a_l / s_l^2 (would-be contribution over
  the layer's noise variance, :func:`score_weights`) times the canary's signed coordinate of
  the released noisy gradient, minus the same read of the data's expected clipped sum at the
  current weights (:meth:`WhiteBoxInstrument._expected_data_sum`); the layers are combined by
  Fisher's discriminant (:func:`combine_statistics`), which down-weights what the noise model
  leaves out (coordinates shared by several canaries in layers smaller than m).
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
:class:`~trainables.dp.randomness.Randomness` of their own (``secure`` when the trial is).

Why the white-box bound stays sound: the theorem needs IN/OUT draws independent of everything
else (OS entropy) and guesses that are a function of the released output; the scores use only
the released noisy gradients (and the weights they produce), the public design (coordinates,
signs, blocks), state that a valid mode derives from public data and released outputs (read
before each step's private batch is touched), the training set (the audit's fixed input, not
its secret) and the auditor's own seeded draws. Sharing a coordinate in a layer smaller than m
mixes other canaries' signal into a canary's statistic: crosstalk that costs power, never
soundness, since the statistic is still read from the release. A step whose private batch is
empty takes the base step's no-gradient path, so IN canaries sampled in it are dropped (counted
in ``dropped_joins``; probability e^(-qN) per step); dropping only lowers each canary's
inclusion probability independently of the data, so the audited mechanism stays within the
claim.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.core.trial import TrialSpec
from dpsweep.trainables.dp.randomness import Randomness
from dpsweep.trainables.dp.step import bound_coefficients

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.dp.step import DPStep
    from dpsweep.trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

WHITE_BOX = "white-box"
BLACK_BOX = "black-box"
KINDS = (WHITE_BOX, BLACK_BOX)
#: A white-box canary's gradient norm in units of the method's clipping norm C (split over the
#: layers by :func:`layer_blocks`, at least 100 C / (2 L) in each): far above C and any layer's
#: threshold, so every clipping or normalising rule saturates on it, yet small enough that an
#: unclipped canary moves its weights by lr x 100 C / (q N) per step, not by overflow.
CANARY_NORM_FACTOR = 100.0
#: Most white-box canaries (their scores and design stay small next to the model).
MAX_WHITE_BOX_CANARIES = 1 << 20
#: A layer's noise std below this fraction of the largest canary block counts as this much in
#: the score's weights: a noiseless layer then dominates the score instead of dividing by 0.
NOISE_FLOOR = 1e-9
#: Separates the audit seed's streams (coordinates, pool picks, wrong labels) from other uses.
_COORDINATE_STREAM = 0xCA11
_REFERENCE_STREAM = 0xCA13
#: Where black-box canaries come from: the split no part of the trial trains on.
CANARY_POOL = "holdout"


def check_count(m: Any, *, limit: int, what: str) -> int:
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= limit:
        raise UserInputError(field="canaries", value=m, allowed=f"an integer in 1..{limit} "
                                                                 f"({what})")
    return int(m)


def draw_membership(m: int) -> np.ndarray:
    """IN (True) or OUT for each of m canaries, each with probability 1/2, from ``os.urandom``.

    The draws are the secret the audit tests, so they are never derived from a seed: anything
    seeded from a recorded value could be replayed by the guesser.
    """
    m = check_count(m, limit=1 << 24, what="canaries to draw")
    raw = np.frombuffer(secrets.token_bytes((m + 7) // 8), dtype=np.uint8)
    return np.unpackbits(raw)[:m].astype(bool)


def canary_sampler(spec: TrialSpec) -> Randomness:
    """The canaries' per-step Poisson source: secret entropy (``secure`` for secure trials),
    separate from the trial's own sampler so that a reproducible trial's seed never decides
    when a canary joins."""
    kind = "secure" if spec.randomness == "secure" else "secret"
    return Randomness(kind=kind, device=torch.device("cpu"))


# ---- white-box: layer-spread gradient canaries -------------------------------------------------
@dataclass(frozen=True, eq=False)
class LayerCanaries:
    """m gradient canaries; canary j's block in layer l is ``blocks[l]`` x sign x one coordinate.

    ``groups`` maps each parameter to (canary ids with their layer coordinate in it, flat
    indices, signs): the public design, drawn from the audit seed by
    :func:`choose_layer_canaries`. Every canary has exactly one coordinate in every layer.
    """

    groups: Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    layer_of: Mapping[str, int]
    m: int
    blocks: tuple[float, ...]  # the block norm of every canary in each layer

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def norms(self, k: int, live: Sequence[bool], *, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """[k, L] per-layer norms of k canary rows: its block in every live layer (a frozen
        layer has no gradient, so a canary has none there either)."""
        row = torch.tensor([b if on else 0.0 for b, on in zip(self.blocks, live, strict=True)],
                           dtype=dtype, device=device)
        return row.unsqueeze(0).expand(k, -1)

    def add_weighted(self, sums: dict[str, torch.Tensor], ids: torch.Tensor,
                     coef: torch.Tensor) -> dict[str, torch.Tensor]:
        """``sums`` plus sum_i coef[i, l] x canary ids[i]'s block in layer l, for every layer."""
        if not len(ids):
            return sums
        full = torch.zeros(self.m, self.num_layers, dtype=torch.float64)
        full[ids.cpu()] = coef.detach().double().cpu()
        out = dict(sums)
        for name, (cid, flat, sign) in self.groups.items():
            if name not in out:  # the parameter's layer is frozen at this step
                continue
            layer = self.layer_of[name]
            vals = full[cid, layer] * sign * self.blocks[layer]
            target = out[name].reshape(-1).clone()
            target.index_add_(0, flat.to(target.device),
                              vals.to(device=target.device, dtype=target.dtype))
            out[name] = target.view_as(sums[name])
        return out

    def read(self, released: Mapping[str, torch.Tensor], weights: np.ndarray) -> np.ndarray:
        """[m, L] weights[l] x canary j's signed coordinate of layer l in the release."""
        out = np.zeros((self.m, self.num_layers))
        for name, (cid, flat, sign) in self.groups.items():
            value = released.get(name)
            layer = self.layer_of[name]
            if value is None or weights[layer] == 0.0:
                continue
            picked = value.detach().reshape(-1)[flat.to(value.device)].double().cpu()
            out[cid.numpy(), layer] = weights[layer] * (sign * picked).numpy()
        return out

    def layer_sharing(self) -> list[float]:
        """Mean number of canaries per used coordinate, per layer (1: all distinct)."""
        used = [0] * self.num_layers
        for name, (_cid, flat, _sign) in self.groups.items():
            used[self.layer_of[name]] += len(torch.unique(flat))
        return [self.m / u if u else 0.0 for u in used]

    def to_dict(self) -> dict[str, Any]:
        return {"m": self.m, "blocks": list(self.blocks), "num_layers": self.num_layers,
                "sharing": self.layer_sharing(),
                "coordinates": {n: {"canary": c.tolist(), "index": f.tolist(),
                                    "sign": s.int().tolist()}
                                for n, (c, f, s) in self.groups.items()}}


def _layer_coordinates(rng: np.random.Generator, *, size: int, m: int) -> np.ndarray:
    """m coordinates of a layer with ``size`` of them: distinct when m <= size, otherwise each
    coordinate taken floor(m / size) or ceil(m / size) times (the fewest sharers possible)."""
    if m <= size:
        return rng.choice(size, size=m, replace=False)
    rounds = [rng.permutation(size) for _ in range(-(-m // size))]
    return np.concatenate(rounds)[:m]


def layer_blocks(sizes: Sequence[int], *, norm: float) -> tuple[float, ...]:
    """Each layer's canary block norm: total ``norm``, split like flat clipping's noise energy
    (in proportion to sqrt(parameters)) but at least 1/L of the way, so that every layer's
    block exceeds any per-layer threshold and a flat-clipped canary puts most of its norm where
    coordinates are plentiful (no sharing, little per-coordinate data gradient)."""
    total = sum(sizes)
    share = np.maximum(np.sqrt(np.asarray(sizes, dtype=float) / total), 1.0 / len(sizes))
    return tuple(float(v) for v in norm * share / np.linalg.norm(share))


def choose_layer_canaries(*, model: LayeredModel, m: int, norm: float,
                          seed: int) -> LayerCanaries:
    """One signed coordinate per canary in every layer, seeded (the auditor knows the design;
    only whether each canary is IN is secret). Layers smaller than m share coordinates."""
    m = check_count(m, limit=MAX_WHITE_BOX_CANARIES, what="white-box canaries")
    layer_of = model.layer_of_parameter()
    named = [(n, p.numel()) for n, p in model.named_parameters()]
    groups: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for layer in range(len(model.layer_names)):
        params = [(n, k) for n, k in named if layer_of[n] == layer]
        rng = np.random.default_rng([int(seed), _COORDINATE_STREAM, layer])
        picks = _layer_coordinates(rng, size=sum(k for _, k in params), m=m)
        signs = rng.choice(np.array([-1.0, 1.0]), size=m)
        ends = np.cumsum([k for _, k in params])
        which = np.searchsorted(ends, picks, side="right")
        starts = ends - np.asarray([k for _, k in params])
        for i, (name, _) in enumerate(params):
            ids = np.flatnonzero(which == i)
            if len(ids):
                groups[name] = (torch.from_numpy(ids).long(),
                                torch.from_numpy(picks[ids] - starts[i]).long(),
                                torch.from_numpy(signs[ids]).double())
    return LayerCanaries(groups=groups, layer_of=layer_of, m=m,
                         blocks=layer_blocks(model.layer_sizes(), norm=norm))


def guarded_coefficients(method: DPStep, norms: torch.Tensor) -> torch.Tensor:
    """The coefficients the method's clip phase releases for rows of ``norms``: its rule,
    capped by the step's guard, without touching the guard's counters."""
    coef, _ = bound_coefficients(method.clip_coefficients(norms), norms,
                                 sensitivity=method.sensitivity(),
                                 layer_bounds=method.layer_bounds())
    return coef


def score_weights(method: DPStep, canaries: LayerCanaries) -> tuple[np.ndarray, np.ndarray]:
    """([L] weights a_l / s_l^2, [L] contributions a_l) of each layer at this step.

    a_l is what one canary row would contribute to layer l after the method's own clipping
    (:func:`guarded_coefficients` on the canaries' norms) and s_l the layer's noise std: for
    Gaussian noise the likelihood-ratio test of "this canary joined" sums a_l / s_l^2 x its
    released coordinate over layers and steps. Both are read before the private batch is
    touched, from state that a valid mode derives from public data and released outputs only,
    so they never depend on the secret membership. A mode that adapts from private data has no
    such state: every live layer then counts 1 for both.
    """
    live = np.asarray(method.trainable_layers(), dtype=bool)
    if not method.dp_valid:
        return live.astype(float), live.astype(float)
    row = canaries.norms(1, live.tolist(), dtype=torch.float64, device=torch.device("cpu"))
    coef = guarded_coefficients(method, row)[0].detach().double().cpu().numpy()
    contribution = np.where(live, coef * row[0].numpy(), 0.0)
    floor = NOISE_FLOOR * max(canaries.blocks)
    std = np.maximum(np.asarray(method.noise_std(), dtype=float), floor)
    return contribution / std ** 2, contribution


def combine_statistics(stats: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """[m] scores from [m, L] per-layer statistics: Fisher's discriminant
    ``stats @ solve(cov, shift)``, where ``shift`` is the expected IN - OUT difference of each
    statistic (per unit join rate) and ``cov`` their covariance over all canaries.

    With Gaussian noise alone the covariance is diagonal and proportional to ``shift``, and the
    result is the plain sum (the likelihood ratio). What the noise model leaves out, other
    canaries sharing coordinates in layers smaller than m and what remains of the data's
    gradient, shows up in ``cov`` and is down-weighted (at epsilon 20 on the digits demo this
    lifts DP-AdamILG's separation from 1.40 to 1.70 standard deviations). The covariance over
    all canaries mixes IN and OUT, which adds a multiple of shift shift^T and leaves the
    direction unchanged; it reads no membership, so the score stays a function of the released
    output and the public design.
    """
    used = shift > 0
    if not used.any() or len(stats) < 2:
        return stats.sum(axis=1)
    x = stats[:, used]
    cov = np.atleast_2d(np.cov(x, rowvar=False))
    direction = np.linalg.lstsq(cov, shift[used], rcond=None)[0]
    return x @ direction


class CanaryView:
    """A gradient view with canary examples appended after the batch's examples.

    ``norms`` is [B + k, L] (the batch's rows, then the k joining canaries'), and
    ``weighted_sum(coef)`` with a [B + k, L] ``coef`` is the base view's sum over the first B
    rows plus each canary's blocks scaled by its coefficients: what concatenating the
    canaries' explicit gradients to the batch would give, without materialising them.
    ``losses`` stay the batch's (monitoring only; a canary has no loss).
    """

    def __init__(self, base: Any, canaries: LayerCanaries, ids: torch.Tensor,
                 live: Sequence[bool]) -> None:
        self.base = base
        self.canaries = canaries
        self.ids = ids
        self.batch = int(base.norms.shape[0])
        extra = canaries.norms(len(ids), live, dtype=base.norms.dtype, device=base.norms.device)
        self.norms = torch.cat([base.norms, extra])
        self.losses = base.losses

    def weighted_sum(self, coef: torch.Tensor) -> dict[str, torch.Tensor]:
        if tuple(coef.shape) != tuple(self.norms.shape):
            raise ValueError(f"coef has shape {tuple(coef.shape)}; the view needs "
                             f"{tuple(self.norms.shape)} (examples + canaries x layers)")
        sums = self.base.weighted_sum(coef[:self.batch])
        return self.canaries.add_weighted(sums, self.ids, coef[self.batch:])


@dataclass
class CanaryCounts:
    steps: int = 0
    joins: int = 0  # IN-canary inclusions that reached a gradient view
    dropped: int = 0  # sampled but dropped: the private batch was empty


class WhiteBoxInstrument:
    """``train_trial(instrument=...)``: layer canaries in the gradient view, statistics from the
    noise phase's output. ``is_member`` is the secret IN/OUT vector; ``scores()`` the result.

    ``reference`` (the trial's training examples) turns on the subtraction of the data's
    expected contribution (:meth:`_expected_data_sum`); ``seed`` draws its subsets.
    """

    def __init__(self, *, m: int, seed: int, is_member: np.ndarray, sampler: Randomness,
                 norm_factor: float = CANARY_NORM_FACTOR,
                 reference: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.m = int(m)
        self.seed = int(seed)
        self.is_member = np.asarray(is_member, dtype=bool)
        if self.is_member.shape != (self.m,):
            raise ValueError(f"is_member has shape {self.is_member.shape}, expected ({m},)")
        self.sampler = sampler
        self.norm_factor = float(norm_factor)
        self.reference = reference
        self._reference_rng = np.random.default_rng([self.seed, _REFERENCE_STREAM])
        self.canaries: LayerCanaries | None = None
        self.stats = np.zeros((self.m, 0))  # [m, L] per-layer statistics, set when installed
        self.shift = np.zeros(0)  # [L] expected IN - OUT difference per unit join rate
        self.counts = CanaryCounts()

    def scores(self) -> np.ndarray:
        """[m] each canary's score (:func:`combine_statistics`)."""
        return combine_statistics(self.stats, self.shift)

    def _expected_data_sum(self, method: DPStep,
                           gradients: Callable[..., Any]) -> dict[str, torch.Tensor] | None:
        """q N x the mean clipped gradient of a fresh random subset of q N training examples at
        the current weights: the expected data part of this step's clipped sum, given what is
        released. Subtracting it removes the data's gradient on each canary coordinate, which
        builds up coherently over the steps and outweighs the noise in small layers.

        A function of the released weights, of state a valid mode derives from public data and
        releases, and of the training set, the audit's fixed input (not its secret); the subset
        is the auditor's own draw. Modes that adapt from private data get no subtraction.
        """
        if self.reference is None or not method.dp_valid:
            return None
        x, y = self.reference
        k = max(1, min(len(y), round(method.expected_batch_size)))
        pick = torch.from_numpy(self._reference_rng.choice(len(y), size=k, replace=False))
        view = gradients(x[pick.to(x.device)], y[pick.to(y.device)])
        scale = method.expected_batch_size / k
        summed = view.weighted_sum(guarded_coefficients(method, view.norms))
        return {n: v * scale for n, v in summed.items()}

    def __call__(self, method: DPStep) -> None:
        canaries = choose_layer_canaries(model=method.model, m=self.m, seed=self.seed,
                                         norm=self.norm_factor * method.clip_norm)
        self.canaries = canaries
        self.stats = np.zeros((self.m, canaries.num_layers))
        self.shift = np.zeros(canaries.num_layers)
        in_ids = torch.from_numpy(np.flatnonzero(self.is_member)).long()
        rate = method.ledger.sample_rate
        begin, step, gradients, noise = (method.begin_step, method.step, method.gradients,
                                         method.noise)
        pending: dict[str, Any] = {}

        def canary_begin(index: int) -> None:
            begin(index)
            if pending.get("releasing"):  # before the private batch is touched
                weights, contribution = score_weights(method, canaries)
                self.shift += weights * contribution
                pending.update(weights=weights, expected=self._expected_data_sum(method,
                                                                                 gradients))

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
            self.counts.joins += len(ids)
            return CanaryView(view, canaries, ids, method.trainable_layers())

        def canary_noise(summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            released = noise(summed)
            if pending.get("releasing"):
                if "weights" not in pending:
                    raise RuntimeError("the step released without calling begin_step first")
                self.stats += canaries.read(released, pending["weights"])
                if pending["expected"] is not None:
                    self.stats -= canaries.read(pending["expected"], pending["weights"])
            return released

        method.begin_step = canary_begin  # type: ignore[method-assign]
        method.step = canary_step  # type: ignore[method-assign]
        method.gradients = canary_gradients  # type: ignore[method-assign]
        method.noise = canary_noise  # type: ignore[method-assign]
