"""The training loop every method shares: one trial = one trained model + metrics + checkpoint.

The loop owns what must be identical across methods for a fair comparison: Poisson sampling at
the exact rate the accountant was given, the step count, evaluation, checkpoints at epoch ends
(so resume is exact), and the privacy record. The method (a :class:`DPStep`) owns the step.
"""

from __future__ import annotations

import io
import math
import platform
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dpsweep.core import __version__, layout
from dpsweep.core.errors import PrivacyBoundViolation, TrialDiverged, UserInputError
from dpsweep.core.layout import CHECKPOINT_FILE
from dpsweep.core.poisson import poisson_plan
from dpsweep.core.records import ACCOUNTANT_IMPLEMENTATIONS, MECHANISM, PrivacyRecord
from dpsweep.core.storage import atomic_write, atomic_write_json
from dpsweep.core.trial import TrialSpec
from dpsweep.trainables.data.files import FileSource
from dpsweep.trainables.data.splits import DataSplits, SplitSizes, load_splits
from dpsweep.trainables.dp.randomness import Randomness, poisson_batches
from dpsweep.trainables.dp.step import DPStep, PublicData
from dpsweep.trainables.methods import get_method
from dpsweep.trainables.models.assemble import build_network
from dpsweep.trainables.models.networks import LayeredModel
from dpsweep.trainables.models.source import ModelSource
from dpsweep.trainables.training.placement import (
    ON_DEVICE,
    decide_placement,
    ensure_headroom,
    gather,
    place,
)

CHECKPOINT_FORMAT = "dpsweep-checkpoint"
#: history.json's per-epoch fraction of clipped examples (``DPStep.clipped``;
#: declared, not covered, by the results store's column of the same name).
CLIPPED_FRACTION = "clipped_fraction"
#: 3: the optimizer state is ``trainables.dp.optim.Update``'s (2 held torch.optim's).
CHECKPOINT_VERSION = 4

__all__ = ["TrialDiverged", "TrialResult", "checked_spec", "evaluate", "load_checkpoint_state",
           "load_model", "load_spec", "spec_file_source", "spec_model_source", "train_trial"]


def spec_model_source(spec: TrialSpec) -> ModelSource:
    """The network a spec trains: a user's (``user_model``) or the built-in ``model``."""
    if spec.user_model:
        return ModelSource.from_dict(spec.user_model)
    return ModelSource(name=spec.model, activation=spec.activation)


def spec_file_source(spec: TrialSpec) -> FileSource | None:
    """A user's data of a spec, or None; files are read only where no pool was shared (a
    worker may lack them)."""
    return (None if spec.data_source is None
            else FileSource.from_dict(spec.data_source, check_files=False))


def checked_spec(spec: TrialSpec) -> TrialSpec:
    """``spec`` with its hyperparameters checked against its method's declaration: the one
    check on the training side (a planner's already validated values pass unchanged)."""
    params = get_method(spec.method).validate_params(spec.method_params)
    return spec if params is spec.method_params else replace(spec, method_params=params)


def load_spec(d: Mapping[str, Any]) -> TrialSpec:
    """A spec arriving as plain data (Ray, ``spec.json``, a checkpoint), rebuilt and checked."""
    return checked_spec(TrialSpec.from_dict(d))


@dataclass
class TrialResult:
    spec: TrialSpec
    history: list[dict[str, Any]]
    privacy_record: PrivacyRecord
    checkpoint_dir: Path | None
    seconds: float
    #: The trained model in memory (references are scored from it without a checkpoint).
    model: LayeredModel | None = None

    @property
    def test_accuracy(self) -> float:
        return float(self.history[-1]["test_accuracy"])

    @property
    def val_accuracy(self) -> float:
        return float(self.history[-1]["val_accuracy"])


Reporter = Callable[[dict[str, Any], Path | None], None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserInputError(field="resources.device", value=name,
                             allowed="'cpu' or 'auto' (no CUDA device is visible)")
    if name.startswith("cuda"):
        full_float32()
    return torch.device(name)


def full_float32() -> None:
    """No TF32 on the GPU: its 10-bit mantissa in cuDNN convolutions made a weighted sum differ
    from the float32 norms it was clipped by about 1e-4 relative (measured on an H200), so a
    release could exceed its sensitivity bound. Every float32 kernel keeps full precision."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _derived_seeds(seed: int) -> tuple[int, int]:
    """(model initialisation, public-batch order): nothing the privacy proof relies on."""
    a, b = np.random.SeedSequence([seed, 0x1217]).generate_state(2)
    return int(a), int(b)


@dataclass
class _Run:
    """The live objects of one trial."""

    spec: TrialSpec
    data: DataSplits
    model: LayeredModel
    method: DPStep
    randomness: Randomness
    sample_rate: float
    steps_per_epoch: int
    device: torch.device
    history: list[dict[str, Any]]
    #: Where the splits live (``trainables.training.placement``) and so where batches are drawn.
    placement: str = ON_DEVICE
    sample_device: torch.device | None = None
    epoch: int = 0


def load_trial_data(spec: TrialSpec) -> DataSplits:
    return load_splits(dataset=spec.dataset, seed=spec.split_seed,
                       sizes=SplitSizes(**spec.sizes) if spec.sizes else None,
                       data_dir=spec.data_dir, source=spec_file_source(spec))


def build_trial_model(spec: TrialSpec, data: DataSplits) -> LayeredModel:
    return build_network(spec_model_source(spec), input_shape=data.input_shape,
                         num_classes=data.num_classes, dataset=data.name,
                         sample=data.shadow.x[:2])


def _build(spec: TrialSpec, data: DataSplits | None) -> _Run:
    device = resolve_device(spec.device)
    torch.set_num_threads(max(1, spec.threads))
    data = load_trial_data(spec) if data is None else data
    n = len(data.train)
    q, steps_per_epoch = poisson_plan(dataset_size=n, batch_size=spec.batch_size)
    if spec.calibration.sample_rate != q:
        raise RuntimeError(f"calibration sample rate {spec.calibration.sample_rate!r} differs "
                           f"from the loader's exact rate {q!r}: the accountant would not cover "
                           "training")
    schedule = spec.calibration.schedule
    if schedule.steps != spec.epochs * steps_per_epoch:
        raise RuntimeError("calibrated step count differs from epochs x steps per epoch")
    seed_model, seed_public = _derived_seeds(spec.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_model)
        model = build_trial_model(spec, data).to(device)
    placement = decide_placement(data, device=device, share=spec.gpu_share)
    sample_device = device if placement == ON_DEVICE else torch.device("cpu")
    randomness = Randomness(kind=spec.randomness, device=device, seed=spec.seed,
                            sample_device=sample_device)
    method_cls = get_method(spec.method)
    method = method_cls(
        model=model, params=spec.method_params, noise_schedule=schedule, sample_rate=q,
        expected_batch_size=q * n, randomness=randomness, steps_per_epoch=steps_per_epoch,
        public=PublicData(x=place(data.shadow.x, placement=placement, device=device),
                          y=place(data.shadow.y, placement=placement, device=device),
                          generator=torch.Generator().manual_seed(seed_public),
                          device=None if placement == ON_DEVICE else device),
        max_physical_batch=spec.max_physical_batch,
    )
    return _Run(spec=spec, data=data, model=model, method=method, randomness=randomness,
                sample_rate=q, steps_per_epoch=steps_per_epoch, device=device, history=[],
                placement=placement, sample_device=sample_device)


@torch.no_grad()
def evaluate(model: LayeredModel, x: torch.Tensor, y: torch.Tensor,
             *, chunk: int = 2048) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over a split, on the model's device (a split kept in
    host memory is copied a chunk at a time). Summed on the device, read once at the end."""
    device = next(model.parameters()).device
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, x.shape[0], chunk):
        xb, yb = x[i:i + chunk].to(device), y[i:i + chunk].to(device)
        out = model(xb)
        loss += F.cross_entropy(out, yb, reduction="sum").double()
        correct += (out.argmax(dim=1) == yb).sum()
    return int(correct) / x.shape[0], float(loss) / x.shape[0]


def save_checkpoint(run: _Run, directory: Path) -> Path:
    """The trial's state after an epoch, written atomically. The noise's and sampler's
    generator states are included only for reproducible trials (``Randomness.state``)."""
    state = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "spec": run.spec.to_dict(),
        "epoch": run.epoch,
        "model": run.model.state_dict(),
        "method": run.method.state_dict(),
        "history": run.history,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write(Path(directory) / CHECKPOINT_FILE, lambda fh: fh.write(buffer.getvalue()))
    return Path(directory)


def load_checkpoint_state(directory: Path) -> dict[str, Any]:
    """Read and validate a checkpoint; any problem is a UserInputError naming the path.

    ``weights_only=True``: a checkpoint is data, never code (a crafted pickle cannot run).
    """
    path = Path(directory) / CHECKPOINT_FILE
    if not path.is_file():
        raise UserInputError(field="checkpoint", value=str(directory),
                             allowed=f"a directory containing {CHECKPOINT_FILE}")
    try:
        with warnings.catch_warnings():  # a refused pickle is reported in one line, below
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt files
        raise UserInputError(field="checkpoint", value=str(path),
                             allowed=f"a readable dpsweep checkpoint ({exc.__class__.__name__})"
                             ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UserInputError(field="checkpoint", value=str(path),
                             allowed=f"a file written by dpsweep (format {CHECKPOINT_FORMAT!r})")
    if state.get("version") != CHECKPOINT_VERSION:
        raise UserInputError(field="checkpoint.version", value=state.get("version"),
                             allowed=f"{CHECKPOINT_VERSION}")
    return state


def _restore(run: _Run, state: dict[str, Any]) -> None:
    if state["spec"] != run.spec.to_dict():
        raise UserInputError(field="checkpoint", value="spec",
                             allowed="a checkpoint of this same trial (its spec differs)")
    run.model.load_state_dict(state["model"])
    run.method.load_state_dict(state["method"])
    run.history = list(state["history"])
    run.epoch = int(state["epoch"])


def load_model(directory: Path, *, data: DataSplits | None = None,
               device: str = "cpu") -> tuple[LayeredModel, TrialSpec]:
    """The trained model stored in a checkpoint, for the audit and for users."""
    state = load_checkpoint_state(directory)
    spec = load_spec(state["spec"])
    model = build_trial_model(spec, load_trial_data(spec) if data is None else data)
    model.load_state_dict(state["model"])
    return model.to(torch.device(device)), spec


def _versions(accountant: str) -> dict[str, str]:
    """The software the record's numbers came from; ``accountant`` names what computed the
    epsilon (``core.records.ACCOUNTANT_IMPLEMENTATIONS``), never a package that was not run."""
    out = {"dpsweep": __version__, "torch": torch.__version__,
           "python": platform.python_version(),
           "accountant": ACCOUNTANT_IMPLEMENTATIONS[accountant]}
    if accountant == "rdp":
        out["dp_accounting"] = metadata.version("dp-accounting")
    return out


def verify_ledger(method: DPStep) -> None:
    """Every step must have been at least as noisy as the schedule the accountant certified
    (a NaN multiplier, which compares false either way, is also refused)."""
    steps = 0
    for event in method.ledger.events:
        for k in range(event["count"]):
            granted = method.sigma_at(steps + k)
            if not event["noise_multiplier"] >= granted * (1 - 1e-9):
                raise PrivacyBoundViolation(
                    f"step {steps + k}: noise multiplier {event['noise_multiplier']} below the "
                    f"certified {granted}; the epsilon claim would not hold")
        steps += event["count"]


def _model_fixes(model: LayeredModel) -> dict[str, Any]:
    """``{"model_fixes": [...]}`` when ``[model] fix`` was set (each module replaced: module,
    was, now, and the ``torch.nn`` kind and kwargs that rebuild it; ``trainables.models.fix``),
    else nothing: the record says what trained."""
    fixes = getattr(model, "model_fixes", None)
    return {} if fixes is None else {"model_fixes": [dict(f) for f in fixes]}


def privacy_record(run: _Run) -> PrivacyRecord:
    """The trial's privacy record, after checking every step was as noisy as certified.

    Every value in it is classed as covered by the epsilon or not in ``reports.store.RECORD``
    (``tests/unit/reports/test_private_values.py`` walks a real record against it): a count or
    statistic of private examples without noise has no place here unless declared there."""
    cal = run.spec.calibration
    verify_ledger(run.method)
    bounds = cal.bounds
    return PrivacyRecord(
        mechanism=MECHANISM,
        method=run.spec.method,
        mode=run.method.mode.name,
        dp_valid=run.method.dp_valid,
        validity_reason=run.method.validity_reason,
        randomness=run.spec.randomness,
        release_safe=run.spec.release_safe,
        sample_rate=cal.sample_rate,
        steps=run.method.ledger.steps,
        noise_multiplier=cal.noise_multiplier,
        noise_schedule=cal.schedule,
        clip_norm=run.spec.clip_norm,
        delta=cal.delta,
        target_epsilon=cal.target_epsilon,
        epsilon_lower=bounds.lower,
        epsilon_estimate=bounds.estimate,
        epsilon_upper=bounds.upper,
        accountant=cal.accountant,
        accountant_fallback=cal.fallback_reason,
        eps_error=cal.eps_error,
        ledger=run.method.ledger.to_dict(),
        guard_capped=run.method.guard_capped,
        method_record={**run.method.extra_record(), "per_example_path": run.method.engine.path,
                       "data_placement": run.placement,
                       "engine_plan": [t.to_dict() for t in run.method.engine.timings],
                       "trained_layers": list(run.method.model.layer_names),
                       "trained_parameters": sum(run.method.model.layer_sizes()),
                       "model_parameters": sum(p.numel() for p in run.model.parameters()),
                       **_model_fixes(run.model)},
        trajectories=run.method.trajectories(),
        versions=_versions(cal.accountant),
    )


def plan_engine(run: _Run, *, cache: Path | None) -> None:
    """Time the engine's candidates on one expected batch of the *public* pool (never private
    examples: the plan is recorded), tiled if the pool is smaller (``GradEngine.measure_plan``).
    A reproducible trial keeps the cost model's plan: timings differ between runs, and a replay
    must take the same kernels to give the same bits."""
    public = run.method.public
    if public is None or len(public.y) == 0 or not run.randomness.release_safe:
        return
    rows = max(1, min(round(run.sample_rate * len(run.data.train)),
                      run.method.engine.max_physical_batch))
    idx = torch.arange(rows, device=public.x.device) % len(public.y)
    x, y = public.x[idx].to(run.device), public.y[idx].to(run.device)
    run.method.engine.measure_plan(x, y, live=run.method.trainable_layers(), cache=cache)


def train_trial(
    spec: TrialSpec,
    *,
    data: DataSplits | None = None,
    checkpoint_root: Path | None = None,
    resume_from: Path | None = None,
    report: Reporter | None = None,
    rolling_checkpoint: str | None = None,
    instrument: Callable[[DPStep], None] | None = None,
    evaluate_epochs: bool = True,
    plan_cache: Path | None = None,
) -> TrialResult:
    """Train one model; checkpoint and report after every epoch.

    ``checkpoint_root/epoch_NNN`` receives a checkpoint per epoch when given; with
    ``rolling_checkpoint`` the one directory ``checkpoint_root/<name>`` is replaced each epoch
    instead, so a sweep stores every model once (the last epoch's checkpoint is the final one).
    Each epoch is evaluated on the validation split (what selection and the pruner read); the
    test split (reported, never read to choose) only after the last epoch, since evaluating it
    every epoch cost 8% of a full-size Fashion-MNIST epoch (``bench/epoch_time.py``) for a
    curve nothing reads. ``evaluate_epochs=False`` skips both (a reference model's curve is
    never read, and evaluating it costs about a tenth of its training). ``instrument(method)``
    is called once with the built (and, on a resume, restored) method before the first step,
    so an audit can wrap its phases without a subclass (``trainables.audit.canaries``).
    Before the first step the engine's plan is measured on public data (``plan_engine``;
    ``plan_cache``: the run's cache folder, where the timings are kept per device and shapes).
    """
    start = time.perf_counter()
    spec = checked_spec(spec)
    run = _build(spec, data)
    if resume_from is not None:
        _restore(run, load_checkpoint_state(resume_from))
    placed = {name: (place(getattr(run.data, name).x, placement=run.placement, device=run.device),
                     place(getattr(run.data, name).y, placement=run.placement, device=run.device))
              for name in ("train", "validation", "test")}
    x_train, y_train = placed.pop("train")
    splits = placed
    plan_engine(run, cache=plan_cache)
    ensure_headroom(run.method, x_train, y_train, device=run.device, share=spec.gpu_share)
    if instrument is not None:
        instrument(run.method)
    last_dir: Path | None = resume_from
    while run.epoch < spec.epochs:
        t0 = time.perf_counter()
        train_loss = _train_epoch(run, x_train, y_train)
        clipped = run.method.clipped.take()
        scores = (_evaluate_epoch(run, splits, test=run.epoch + 1 >= spec.epochs)
                  if evaluate_epochs else {})
        run.epoch += 1
        metrics = {
            "epoch": run.epoch,
            "step": run.method.step_count,
            "train_loss_nonprivate": train_loss,
            **({} if clipped is None else {CLIPPED_FRACTION: clipped}),
            **scores,
            "epsilon_spent": float(spec.epsilon_curve[run.epoch - 1]),
            "noise_multiplier": run.method.sigma_at(run.method.step_count - 1),
            "epoch_seconds": time.perf_counter() - t0,
            **run.method.epoch_metrics(),
        }
        run.history.append(metrics)
        ckpt_dir = None
        if checkpoint_root is not None:
            name = rolling_checkpoint or f"epoch_{run.epoch:03d}"
            ckpt_dir = save_checkpoint(run, Path(checkpoint_root) / name)
            last_dir = ckpt_dir
        if report is not None:
            report(metrics, ckpt_dir)
    record = privacy_record(run)
    if checkpoint_root is not None:
        _write_records(Path(checkpoint_root), record=record, run=run)
    return TrialResult(spec=spec, history=run.history, privacy_record=record,
                       checkpoint_dir=last_dir, seconds=time.perf_counter() - start,
                       model=run.model)


def _train_epoch(run: _Run, x_train: torch.Tensor, y_train: torch.Tensor) -> float:
    """One epoch of Poisson-sampled steps; the mean non-private training loss (never released).

    The batches are drawn where the data are and gathered onto the model's device
    (``trainables.training.placement``); the loss is summed on the device and read once, at the
    end of the epoch, so no step waits for the device (a non-finite loss still ends the trial here).
    """
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    seen = 0
    run.model.train()
    for idx in poisson_batches(n=len(y_train), rate=run.sample_rate,
                               steps=run.steps_per_epoch, randomness=run.randomness,
                               device=run.sample_device or run.device):
        x, y = gather(x_train, y_train, idx, device=run.device)
        losses = run.method.step(x, y)
        loss_sum += losses.detach().sum(dtype=torch.float64)
        seen += losses.numel()
    train_loss = float(loss_sum) / max(seen, 1)
    if not math.isfinite(train_loss):
        raise TrialDiverged(f"train loss became {train_loss} in epoch {run.epoch + 1}")
    run.model.eval()
    return train_loss


def _evaluate_epoch(run: _Run, splits: dict[str, tuple[torch.Tensor, torch.Tensor]], *,
                    test: bool) -> dict[str, float]:
    """Validation accuracy and loss after an epoch (what selection and the pruner read); with
    ``test``, the test split's too (reported for the final model only)."""
    val_acc, val_loss = evaluate(run.model, *splits["validation"])
    if not math.isfinite(val_loss):
        raise TrialDiverged(f"validation loss became {val_loss} in epoch {run.epoch + 1}")
    scores = {"val_accuracy": val_acc, "val_loss": val_loss}
    if test:
        test_acc, test_loss = evaluate(run.model, *splits["test"])
        if not math.isfinite(test_loss):
            raise TrialDiverged(f"test loss became {test_loss} in epoch {run.epoch + 1}")
        scores.update(test_accuracy=test_acc, test_loss=test_loss)
    return scores


def _write_records(directory: Path, *, record: PrivacyRecord, run: _Run) -> None:
    """The trial's JSON records beside its checkpoint: privacy, history, spec."""
    record.save(directory / layout.PRIVACY)
    atomic_write_json(directory / layout.HISTORY, run.history)
    atomic_write_json(directory / layout.SPEC, run.spec.to_dict())
