"""Reference models for calibrated membership attacks: which data each trains on, how, and
their signals on the audited examples.

Two plans (Carlini et al. 2022, arXiv 2112.03570, Sec. IV; Zarifzadeh et al. 2024, arXiv
2312.03262):

* ``online`` — the population is the target's members (train split) and non-members (holdout
  split), both private. References come in pairs that split one seeded permutation of the
  population into two disjoint halves, so every candidate is IN for exactly half of an even
  number of references (the LiRA recipe; a random half per reference leaves some candidates
  with no IN or no OUT model when K is small). Each reference trains on floor(|population|/2)
  examples, the target's training-set size when members and non-members are equally many.
* ``offline`` — references train on subsets of the *public* shadow pool, so no candidate is
  ever IN (cheaper to keep: the same references serve every target of a sweep). Each reference
  trains on the target's training-set size when the pool holds twice that, otherwise on half the
  pool (:attr:`ReferencePlan.note` says so): a reference trained on fewer examples overfits more
  than the target, which biases the OUT fits little (OUT values of a model depend weakly on its
  size) but is recorded.

Candidates are a balanced subsample of members and non-members (``max_candidates`` per class),
so 0.5 accuracy is chance. The population samples z (RMIA's, and the labelled data that
calibrates offline thresholds) come from the public pool, never from the target's data; only
offline plans draw them.

Reference training never touches the target's noise: a DP target's references are trained by
dpsweep's own loop (:func:`dp_trainer`, ``train_trial`` with the target's spec, a fresh seed
derived from (audit seed, reference index), and a calibration the caller supplies for the
reference's training-set size: budgets are matched by the orchestrator, never inside a trial);
a non-private target's by :func:`train_nonprivate`. Every reference starts from the target's
frozen parameters, which never train (``trainables.audit.prefix``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.core.poisson import PHYSICAL_BATCH
from dpsweep.core.trial import Calibration, TrialSpec
from dpsweep.trainables.audit.prefix import (
    FrozenStart,
    SharedPrefix,
    share_prefix,
    start_of,
    start_record,
    training_start,
    with_start,
)
from dpsweep.trainables.audit.scores import (
    ATTACKS,
    LOSS_THRESHOLD,
    RMIA,
    AttackScores,
    SignalObservations,
    attack_signal,
    loss_threshold,
)
from dpsweep.trainables.audit.signals import (
    LOSS,
    SharingSignals,
    Signals,
    member_direction,
    membership_probability,
    per_example_signals,
    rmia_input,
)
from dpsweep.trainables.data.splits import DataSplits, Split
from dpsweep.trainables.dp.optim import Update
from dpsweep.trainables.models.assemble import build_network
from dpsweep.trainables.models.source import ModelSource
from dpsweep.trainables.training.loop import build_trial_model, train_trial

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

PLANS = ("online", "offline")
#: Fewest references: a pooled variance needs two values on one side of some candidate, and
#: an offline threshold a reference acting as the target with two others beside it.
MIN_REFERENCES = 4
# The number of references is the config's ``audit.reference_models`` (default 4, its floor
# MIN_REFERENCES). Each costs about one target training (same recipe; online references train
# on half of the audited members and non-members, offline ones on the target's training-set
# size) plus its signals. How much each plan and count finds: bench/audit_strength.py, whose
# figures ``trainables.audit.plan_statement`` carries into every audit record.
#: Public population samples z drawn from the shadow pool for offline plans (RMIA's z, offline
#: calibration); online plans draw none (:func:`plan_references`).
DEFAULT_POPULATION = 1000
#: Separates this module's random streams from other users of the audit seed.
_PLAN_TAG = 0xA0D1
_SEED_TAG = 0x5EED
#: Reference blocks are 31-bit (:func:`reference_block`).
BLOCK_MASK = 0x7FFFFFFF


# --- the non-private recipe (the audit's positive control) -----------------------------------


@dataclass(frozen=True)
class NonPrivateRecipe:
    """Plain Adam training without clipping, noise or regularisation: the audit's leaky
    reference, deliberately trained to memorise a small training set."""

    epochs: int = 800
    lr: float = 3e-3
    batch_size: int = 32
    #: The network (``trainables.models.source.ModelSource.to_dict()``; default: the built-in
    #: "auto" model of the dataset).
    model_source: dict = field(default_factory=dict)


def train_nonprivate(*, data: DataSplits, recipe: NonPrivateRecipe, seed: int,
                     threads: int | None = 1,
                     on_epoch: Callable[[int, LayeredModel], None] | None = None
                     ) -> tuple[LayeredModel, float]:
    """(model, seconds): the recipe applied to ``data.train``, shuffled minibatches, CPU.

    ``threads`` sets torch's intra-op threads (None leaves them): one thread is several
    times faster than two for these small models on a shared machine. A reference's ``data``
    may carry what it starts from (``trainables.audit.prefix.FrozenStart``). ``on_epoch(k,
    model)`` hears the end of each epoch k (1-based; the model in eval mode until it returns;
    its time is not counted): the sweep's baseline job reports its progress from it.
    """
    start = time.perf_counter()
    heard = 0.0  # seconds spent in on_epoch, not training
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = _nonprivate_model(data, recipe)
    optimizer = Update(model.named_parameters(), kind="adam", lr=recipe.lr)
    generator = torch.Generator().manual_seed(seed)
    x, y = data.train.x, data.train.y
    with contextlib.ExitStack() as stack:
        if (frozen := start_of(data)) is not None:
            frozen.prepare(model, stack=stack)
        model.train()
        for epoch in range(1, recipe.epochs + 1):
            order = torch.randperm(len(y), generator=generator)
            for i in range(0, len(y), recipe.batch_size):
                batch = order[i:i + recipe.batch_size]
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                optimizer.step()
            if on_epoch is not None:
                told = time.perf_counter()
                model.eval()
                on_epoch(epoch, model)
                model.train()
                heard += time.perf_counter() - told
    model.eval()
    return model, time.perf_counter() - start - heard


def _nonprivate_model(data: DataSplits, recipe: NonPrivateRecipe) -> LayeredModel:
    """The recipe's untrained network for ``data`` (initialised from torch's global RNG)."""
    source = ModelSource.from_dict(recipe.model_source) if recipe.model_source else ModelSource()
    return build_network(source, input_shape=data.input_shape, num_classes=data.num_classes,
                         dataset=data.name, sample=data.shadow.x[:2])


def accuracy(model: LayeredModel, split: Split) -> float:
    """Top-1 accuracy of ``model`` on ``split``."""
    model.eval()
    with torch.no_grad():
        return float((model(split.x).argmax(dim=1) == split.y).float().mean())


# --- plans -----------------------------------------------------------------------------------


def subset(split: Split, rows: np.ndarray) -> Split:
    """The rows of a split (its pool indices follow)."""
    index = torch.as_tensor(np.asarray(rows), dtype=torch.long)
    return Split(x=split.x[index], y=split.y[index], indices=split.indices[np.asarray(rows)])


def concat(first: Split, second: Split) -> Split:
    """Two splits one after the other."""
    return Split(x=torch.cat([first.x, second.x]), y=torch.cat([first.y, second.y]),
                 indices=np.concatenate([first.indices, second.indices]))


@dataclass(frozen=True, eq=False)
class ReferencePlan:
    """Which examples are audited, and which examples each reference model trains on."""

    kind: str  # "online" or "offline"
    seed: int  # the audit seed
    candidates: Split  # the audited examples: target members first, then non-members
    is_member: np.ndarray  # [N] target membership of the candidates (evaluation only)
    population: Split  # public samples z, from the shadow pool
    source: Split  # what references draw their training sets from
    train_rows: tuple[np.ndarray, ...]  # per reference: rows of ``source`` it trains on
    in_mask: np.ndarray  # [K, N] reference k trained on candidate n
    population_in_mask: np.ndarray  # [K, M] reference k trained on population sample m
    reference_size: int  # training-set size of every reference (what budgets are matched for)
    note: str  # how the sizes were chosen, when it deviates from the target's
    block: int = 0  # which of the audit seed's reference blocks (:func:`reference_block`)

    @property
    def n_references(self) -> int:
        return len(self.train_rows)


def _balanced_candidates(data: DataSplits, *, max_per_class: int | None,
                         rng: np.random.Generator) -> tuple[Split, np.ndarray]:
    m = min(len(data.train), len(data.holdout))
    if max_per_class is not None:
        m = min(m, max_per_class)
    members = np.sort(rng.choice(len(data.train), m, replace=False))
    nonmembers = np.sort(rng.choice(len(data.holdout), m, replace=False))
    split = concat(subset(data.train, members), subset(data.holdout, nonmembers))
    return split, np.r_[np.ones(m, np.int64), np.zeros(m, np.int64)]


def plan_references(*, data: DataSplits, kind: str, n_references: int, seed: int,
                    max_candidates: int | None = None,
                    population_size: int = DEFAULT_POPULATION, block: int = 0) -> ReferencePlan:
    """The plan for ``n_references`` references of ``kind`` (module docstring).

    ``max_candidates`` caps the audited members (and as many non-members); None audits
    min(|train|, |holdout|) of each. The candidates depend on ``seed`` alone; the references'
    training halves and seeds also on ``block``: plans of one seed and different blocks audit
    the same candidates with independent references, which can then be pooled (the sweep's
    trials of one study each train one block, ``orchestrator.audit.pooling``).
    """
    if kind not in PLANS:
        raise UserInputError(field="audit.references", value=kind, allowed=f"one of {PLANS}")
    if isinstance(n_references, bool) or not isinstance(n_references, int) \
            or n_references < MIN_REFERENCES:
        raise UserInputError(field="audit.reference_models", value=n_references,
                             allowed=f"an integer >= {MIN_REFERENCES}")
    if max_candidates is not None and max_candidates < 1:
        raise UserInputError(field="audit.max_candidates", value=max_candidates,
                             allowed="an integer >= 1 or None")
    if isinstance(block, bool) or not isinstance(block, int) or block < 0:
        raise UserInputError(field="audit block", value=block, allowed="an integer >= 0")
    rng = np.random.default_rng([seed, _PLAN_TAG])
    candidates, is_member = _balanced_candidates(data, max_per_class=max_candidates, rng=rng)
    pool = data.shadow
    # Online plans read no population: their thresholds calibrate on the candidates (each is
    # IN for half the references) and RMIA ranks by its log ratio, so every model's signals on
    # population samples would be computed for nothing (a third of them at the defaults).
    drawn = 0 if kind == "online" else min(population_size, len(pool))
    population = subset(pool, np.sort(rng.choice(len(pool), drawn, replace=False)))
    note = ""
    if kind == "online":
        source = concat(data.train, data.holdout)
        size = len(source) // 2
        if size != len(data.train):
            note = (f"online references train on half the population ({size} examples); the "
                    f"target trained on {len(data.train)}")
    else:
        source = pool
        if 2 * len(data.train) <= len(pool):
            size = len(data.train)
        else:
            size = len(pool) // 2
            note = (f"the shadow pool ({len(pool)}) is smaller than twice the target's training "
                    f"set ({len(data.train)}): offline references train on half the pool "
                    f"({size} examples)")
    if size < 1:
        raise UserInputError(field="data.shadow_size" if kind == "offline" else "data.sizes",
                             value=len(source), allowed="at least two examples to split")
    rows = []
    pairs = (n_references + 1) // 2
    for k in range(n_references):
        perm = np.random.default_rng([seed, _PLAN_TAG, int(kind == "online"),
                                      block * pairs + k // 2]).permutation(len(source))
        rows.append(np.sort(perm[:size] if k % 2 == 0 else perm[size:2 * size]))
    in_mask = np.stack([np.isin(candidates.indices, source.indices[r]) for r in rows])
    population_in_mask = np.stack([np.isin(population.indices, source.indices[r])
                                   for r in rows])
    return ReferencePlan(kind=kind, seed=seed, candidates=candidates, is_member=is_member,
                         population=population, source=source, train_rows=tuple(rows),
                         in_mask=in_mask, population_in_mask=population_in_mask,
                         reference_size=size, note=note, block=block)


def reference_data(plan: ReferencePlan, data: DataSplits, *, index: int) -> DataSplits:
    """Reference ``index``'s splits: train = its rows of the plan's source, holdout = the rest of
    the source; validation and test are the target's (monitoring only). Its public data
    (``shadow``, read by methods with public modes) is the target's public pool for online
    references and the pool minus its own training rows for offline ones."""
    rows = plan.train_rows[index]
    rest = np.setdiff1d(np.arange(len(plan.source)), rows)
    public = data.shadow if plan.kind == "online" else subset(plan.source, rest)
    return dataclasses.replace(data, train=subset(plan.source, rows),
                               holdout=subset(plan.source, rest), shadow=public)


def reference_block(trial_id: str) -> int:
    """The block of references a trial trains (:func:`plan_references`): a digest of its id,
    so trials of one sweep draw independent halves and seeds without coordinating (two ids
    share a block with probability about 2^-31 per pair), and an audit run again trains the
    same references."""
    digest = hashlib.sha256(f"dpsweep-reference-block:{trial_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & BLOCK_MASK


def reference_seed(*, audit_seed: int, index: int) -> int:
    """The training seed of reference ``index`` (counted over blocks: block b's reference k
    is index b * K + k): distinct per reference and audit seed, and unrelated to the target's
    seed and noise."""
    return int(np.random.SeedSequence([audit_seed, index, _SEED_TAG]).generate_state(1)[0]
               & 0x7FFFFFFF)


# --- training references ---------------------------------------------------------------------


#: ``trainer(data, seed, index) -> (model, seconds)``.
ReferenceTrainer = Callable[[DataSplits, int, int], "tuple[LayeredModel, float]"]


@dataclass(frozen=True)
class Budget:
    """A calibration matched by the orchestrator for one training-set size: the
    ``Calibration`` a ``TrialSpec`` carries and the accountant's epsilon per epoch."""

    calibration: Calibration
    epsilon_curve: list[float]


Budgets = Mapping[int, Budget] | Callable[[int], Budget]


def _budget_for(budgets: Budgets, size: int) -> Budget:
    if callable(budgets):
        return budgets(size)
    if size not in budgets:
        raise UserInputError(field="audit.budgets", value=sorted(budgets),
                             allowed=f"a calibration for the references' training-set size "
                                     f"{size}")
    return budgets[size]


def reference_spec(spec: TrialSpec, *, dataset_size: int, budgets: Budgets, seed: int,
                   index: int) -> TrialSpec:
    """The target's spec (method, hyperparameters, epochs, batch size, model) with the budget
    matched for ``dataset_size`` at the target's (epsilon, delta) and a reference seed."""
    budget = _budget_for(budgets, dataset_size)
    return dataclasses.replace(spec, calibration=budget.calibration,
                               epsilon_curve=list(budget.epsilon_curve), seed=seed, sizes=None,
                               trial_id=f"{spec.trial_id}-ref{index}")


#: TrialSpec fields that do not change what a reference learns (names, placement, paths; the
#: data themselves are fingerprinted by the cache).
_UNLEARNED_FIELDS = ("trial_id", "device", "threads", "max_physical_batch", "data_dir", "sizes")


@dataclass(frozen=True)
class DPReferenceTrainer:
    """References trained like a DP target: ``train_trial`` on the reference's data, kept in
    memory (no checkpoint) and not evaluated per epoch (nothing reads a reference's curve). The
    DP step trains only the target's trainable parameters (``TrainableLayers``: frozen ones get
    no gradient, noise, optimiser state or update); a reference's ``data`` may carry the
    target's frozen parameters to start from (``trainables.audit.prefix.FrozenStart``).
    ``plan_cache``: the run's cache folder, where the target's engine plan was kept (the
    references' batches have the target's expected size, so they take its plan instead of
    timing the engine's candidates again: a few steps' time per reference)."""

    spec: TrialSpec
    budgets: Budgets
    plan_cache: Path | None = None

    def _spec(self, data: DataSplits, seed: int, index: int) -> TrialSpec:
        return reference_spec(self.spec, dataset_size=len(data.train), budgets=self.budgets,
                              seed=seed, index=index)

    def __call__(self, data: DataSplits, seed: int, index: int) -> tuple[LayeredModel, float]:
        start = start_of(data)
        with contextlib.ExitStack() as stack:
            result = train_trial(self._spec(data, seed, index), data=data, evaluate_epochs=False,
                                 plan_cache=self.plan_cache,
                                 instrument=None if start is None else
                                 (lambda method: start.prepare(method.model.model, stack=stack)))
        if result.model is None:
            raise RuntimeError(f"reference {index} of {self.spec.trial_id} returned no model")
        return result.model.to("cpu").eval(), result.seconds

    def describe(self, data: DataSplits, seed: int, index: int) -> dict[str, Any]:
        """The reference's spec (method, hyperparameters, matched budget, seed) without the
        fields that only name or place it."""
        spec = self._spec(data, seed, index).to_dict()
        return {"trainer": "dp", **{k: v for k, v in spec.items()
                                    if k not in _UNLEARNED_FIELDS}, **start_record(data)}

    def blank(self, data: DataSplits) -> LayeredModel:
        with torch.random.fork_rng(devices=[]):
            return build_trial_model(self.spec, data).eval()


def dp_trainer(spec: TrialSpec, *, budgets: Budgets,
               plan_cache: Path | None = None) -> DPReferenceTrainer:
    """References trained like the DP target ``spec`` (:class:`DPReferenceTrainer`)."""
    return DPReferenceTrainer(spec=spec, budgets=budgets, plan_cache=plan_cache)


@dataclass(frozen=True)
class NonPrivateReferenceTrainer:
    """References trained like a non-private target, by :func:`train_nonprivate`."""

    recipe: NonPrivateRecipe
    threads: int | None = 1

    def __call__(self, data: DataSplits, seed: int, index: int) -> tuple[LayeredModel, float]:
        del index
        return train_nonprivate(data=data, recipe=self.recipe, seed=seed, threads=self.threads)

    def describe(self, data: DataSplits, seed: int, index: int) -> dict[str, Any]:
        del index
        return {"trainer": "nonprivate", "recipe": dataclasses.asdict(self.recipe),
                "seed": seed, **start_record(data)}

    def blank(self, data: DataSplits) -> LayeredModel:
        with torch.random.fork_rng(devices=[]):
            return _nonprivate_model(data, self.recipe).eval()


def nonprivate_trainer(recipe: NonPrivateRecipe, *,
                       threads: int | None = 1) -> NonPrivateReferenceTrainer:
    """References trained like a non-private target (:class:`NonPrivateReferenceTrainer`)."""
    return NonPrivateReferenceTrainer(recipe=recipe, threads=threads)


# --- signals of target and references --------------------------------------------------------


#: ``extra(model, x, y) -> {name: [N]}``: further signals per model (alternatives in benches).
ExtraSignals = Callable[["LayeredModel", "torch.Tensor", "torch.Tensor"], Signals]


@dataclass(frozen=True)
class ReferenceRecord:
    """What one reference model was."""

    index: int
    seed: int
    n_train: int
    test_accuracy: float
    train_seconds: float
    signal_seconds: float


@dataclass(frozen=True, eq=False)
class AuditSignals:
    """Signals of the target and every reference on the candidates and the population."""

    plan: ReferencePlan
    target: Signals  # name -> [N]
    population_target: Signals  # name -> [M]
    references: Signals  # name -> [K, N]
    population_references: Signals  # name -> [K, M]
    records: tuple[ReferenceRecord, ...]
    target_signal_seconds: float

    def observations(self, name: str, *, n_references: int | None = None,
                     direction: int | None = None,
                     probability: Callable[[np.ndarray], np.ndarray] | None = None
                     ) -> SignalObservations:
        """Signal ``name`` as the attacks take it, with the first ``n_references`` references
        (all by default); direction and probability default to the signal's own."""
        k = self.plan.n_references if n_references is None else n_references
        if not MIN_REFERENCES <= k <= self.plan.n_references:
            raise UserInputError(field="audit.reference_models", value=k,
                                 allowed=f"{MIN_REFERENCES}..{self.plan.n_references}")
        return SignalObservations(
            name=name,
            direction=member_direction(name) if direction is None else direction,
            probability=(probability if probability is not None
                         else (lambda v: membership_probability(name=name, values=v))),
            target=self.target[name], references=self.references[name][:k],
            in_mask=self.plan.in_mask[:k],
            population_references=self.population_references[name][:k],
            population_in_mask=self.plan.population_in_mask[:k])


def _signals(model: LayeredModel, x: torch.Tensor, y: torch.Tensor, *, batch: int,
             extra: ExtraSignals | None, shared: SharedPrefix | None) -> Signals:
    """Every signal of ``model``; its prefix read from ``shared`` when it covers ``model``."""
    if shared is not None and not shared.prefix.covers(model):
        shared = None
    out = per_example_signals(model=model, x=x, y=y, batch=batch, shared=shared)
    if extra is not None:
        out.update(extra.shared(model, x, y, prefix=shared)
                   if shared is not None and isinstance(extra, SharingSignals)
                   else extra(model, x, y))
    return out


def collect_signals(*, target: LayeredModel, data: DataSplits, plan: ReferencePlan,
                    trainer: ReferenceTrainer, batch: int = PHYSICAL_BATCH,
                    extra: ExtraSignals | None = None,
                    progress: Callable[[ReferenceRecord], None] | None = None) -> AuditSignals:
    """Train every reference of ``plan`` and compute its signals (and the target's) on the
    candidates and the population; each reference is dropped once its signals are taken.

    References start from the target's frozen parameters, and a frozen prefix is computed once
    per example for all models (``trainables.audit.prefix``)."""
    # an online plan has no population: the candidates' own tensor, so that every reader of
    # a model's layers on it shares one forward (``trainables.audit.layer_attack.ir_features``)
    x = (torch.cat([plan.candidates.x, plan.population.x]) if len(plan.population)
         else plan.candidates.x)
    y = torch.cat([plan.candidates.y, plan.population.y])
    n = len(plan.candidates)
    t0 = time.perf_counter()
    shared = share_prefix(target, x, batch=batch,
                          features=extra.features if isinstance(extra, SharingSignals) else None)
    own = _signals(target, x, y, batch=batch, extra=extra, shared=shared)
    target_seconds = time.perf_counter() - t0
    start = training_start(FrozenStart.of(target), shared, target=target, source=plan.source.x,
                           rows=plan.train_rows)
    per_ref: list[Signals] = []
    records = []
    for k in range(plan.n_references):
        rdata = with_start(reference_data(plan, data, index=k), start)
        seed = reference_seed(audit_seed=plan.seed, index=plan.block * plan.n_references + k)
        model, seconds = trainer(rdata, seed, k)
        t1 = time.perf_counter()
        per_ref.append(_signals(model, x, y, batch=batch, extra=extra, shared=shared))
        record = ReferenceRecord(index=k, seed=seed, n_train=len(rdata.train),
                                 test_accuracy=accuracy(model, data.test), train_seconds=seconds,
                                 signal_seconds=time.perf_counter() - t1)
        records.append(record)
        if progress is not None:
            progress(record)
        del model
    stacked = {name: np.stack([s[name] for s in per_ref]) for name in own}
    return AuditSignals(
        plan=plan, target={k: v[:n] for k, v in own.items()},
        population_target={k: v[n:] for k, v in own.items()},
        references={k: v[:, :n] for k, v in stacked.items()},
        population_references={k: v[:, n:] for k, v in stacked.items()},
        records=tuple(records), target_signal_seconds=target_seconds)


def score_signals(signals: AuditSignals, *, names: list[str] | None = None,
                  n_references: int | None = None, attacks: tuple[str, ...] = ATTACKS,
                  variance: str = "auto") -> dict[str, dict[str, AttackScores]]:
    """{signal: {attack: scores}} for every signal (all by default) with the first
    ``n_references`` references; the ``loss`` signal also gets the uncalibrated
    loss-threshold baseline (key ``"loss_threshold"``). RMIA runs once per distinct input
    (:func:`~trainables.audit.signals.rmia_input`): not on ``loss`` when ``logit`` is scored."""
    chosen = list(signals.target) if names is None else names
    out: dict[str, dict[str, AttackScores]] = {}
    for name in chosen:
        obs = signals.observations(name, n_references=n_references)
        own = rmia_input(name)
        wanted = tuple(a for a in attacks
                       if a != RMIA or own == name or own not in chosen)
        out[name] = attack_signal(obs, attacks=wanted, variance=variance)
        if name == LOSS:
            out[name][LOSS_THRESHOLD] = loss_threshold(obs)
    return out
