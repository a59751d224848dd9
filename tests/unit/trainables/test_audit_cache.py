"""Reference models kept between audits (trainables/audit/cache.py): a hit returns the very
weights that were trained, the key changes with recipe, data and budget, and an entry that fails
verification (torn weights, a pickle in place of safetensors) is retrained, never loaded."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from dpsweep.orchestrator.door import check
from dpsweep.trainables.audit.cache import NAMESPACE, CachingTrainer, caching, reference_key
from dpsweep.trainables.audit.references import (
    Budget,
    NonPrivateRecipe,
    NonPrivateReferenceTrainer,
    dp_trainer,
    nonprivate_trainer,
    plan_references,
    reference_data,
    reference_seed,
)
from dpsweep.trainables.data.splits import DataSplits, SplitSizes, load_splits
from tests.unit.core.test_cache_hints import KINDS, no_hang, plant

SIZES = SplitSizes(train=100, validation=100, holdout=100, test=100, shadow=400)
#: Two epochs on 100 digits: a trained, non-initial model in well under a second.
RECIPE = NonPrivateRecipe(epochs=2, lr=3e-3, batch_size=32)


@pytest.fixture(scope="module")
def data() -> DataSplits:
    torch.set_num_threads(1)
    return load_splits(dataset="digits", seed=0, sizes=SIZES)


@pytest.fixture(scope="module")
def references(data: DataSplits) -> list[DataSplits]:
    plan = plan_references(data=data, kind="offline", n_references=4, seed=1)
    return [reference_data(plan, data, index=k) for k in range(2)]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_hit_returns_the_trained_weights(tmp_path: Path,
                                           references: list[DataSplits]) -> None:
    calls: list[int] = []

    class Counting(NonPrivateReferenceTrainer):
        def __call__(self, data: DataSplits, seed: int, index: int) -> tuple:
            calls.append(index)
            return super().__call__(data, seed, index)

    trainer = Counting(recipe=RECIPE)
    first = CachingTrainer(trainer, tmp_path)
    seed = reference_seed(audit_seed=1, index=0)
    trained, seconds = first(references[0], seed, 0)
    assert calls == [0] and first.hits == set()
    files = sorted(p.suffix for p in (tmp_path / NAMESPACE).iterdir())
    assert files == [".json", ".safetensors"]
    again = CachingTrainer(trainer, tmp_path)
    loaded, cached_seconds = again(references[0], seed, 0)
    assert calls == [0] and again.hits == {0}  # not trained again
    assert _same_weights(trained, loaded) and cached_seconds == seconds
    assert not loaded.training
    x = references[0].test.x[:20]
    with torch.no_grad():
        assert torch.equal(trained.eval()(x), loaded(x))


def test_the_key_follows_recipe_data_and_budget(references: list[DataSplits]) -> None:
    trainer = nonprivate_trainer(RECIPE)
    key = reference_key(trainer, references[0], seed=5, index=0)
    assert key == reference_key(nonprivate_trainer(RECIPE, threads=2), references[0], seed=5,
                                index=3)  # threads and index do not change what is learnt
    other_recipe = nonprivate_trainer(dataclasses.replace(RECIPE, lr=1e-3))
    assert reference_key(other_recipe, references[0], seed=5, index=0) != key
    assert reference_key(trainer, references[1], seed=5, index=0) != key
    assert reference_key(trainer, references[0], seed=6, index=0) != key
    assert key["data"]["train"] != reference_key(trainer, references[1], seed=5,
                                                 index=0)["data"]["train"]


def test_a_dp_reference_key_holds_its_budget_not_its_name() -> None:
    from dpsweep.orchestrator.trial.plan import plan_trial
    from tests.conftest import tiny_config

    digits = load_splits(dataset="digits", seed=0)
    spec = plan_trial(check(tiny_config()), trial_id="dp", data=digits)
    rdata = reference_data(plan_references(data=digits, kind="offline", n_references=4,
                                           seed=2), digits, index=1)
    budget = Budget(calibration=spec.calibration, epsilon_curve=list(spec.epsilon_curve))
    looser = Budget(calibration=dataclasses.replace(spec.calibration, target_epsilon=99.0),
                    epsilon_curve=list(spec.epsilon_curve))
    a = dp_trainer(spec, budgets={250: budget}).describe(rdata, 7, 1)
    renamed = dataclasses.replace(spec, trial_id="dp-r1", device="cpu", threads=2)
    assert dp_trainer(renamed, budgets={250: budget}).describe(rdata, 7, 1) == a
    assert dp_trainer(spec, budgets={250: looser}).describe(rdata, 7, 1) != a
    assert a["calibration"] == spec.calibration.to_dict() and a["seed"] == 7
    assert "trial_id" not in a and a["method"] == spec.method
    model = dp_trainer(spec, budgets={250: budget}).blank(rdata)
    assert not model.training


def _entry_files(directory: Path) -> tuple[Path, Path]:
    folder = directory / NAMESPACE
    return next(folder.glob("*.json")), next(folder.glob("*.safetensors"))


def test_an_entry_failing_verification_is_retrained_not_loaded(
        tmp_path: Path, references: list[DataSplits]) -> None:
    trainer = nonprivate_trainer(RECIPE)
    seed = reference_seed(audit_seed=1, index=1)
    trained, _ = CachingTrainer(trainer, tmp_path)(references[1], seed, 1)
    entry, weights = _entry_files(tmp_path)
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF  # a torn or edited weights file
    weights.write_bytes(bytes(blob))
    torn = CachingTrainer(trainer, tmp_path)
    model, _ = torn(references[1], seed, 1)
    assert torn.hits == set() and "SHA-256" in torn.rejected[1]
    assert _same_weights(model, trained)  # retrained (the recipe is deterministic on CPU)
    rehit = CachingTrainer(trainer, tmp_path)
    rehit(references[1], seed, 1)
    assert rehit.hits == {1}  # the entry was rewritten
    # a pickle in place of the weights, its hash recorded as if genuine: never unpickled
    torch.save(trained.state_dict(), weights)
    value = json.loads(entry.read_text())
    value["value"]["sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    entry.write_text(json.dumps(value))
    pickled = CachingTrainer(trainer, tmp_path)
    pickled(references[1], seed, 1)
    assert pickled.hits == set() and 1 in pickled.rejected


def test_caching_needs_a_directory_and_a_trainer_that_describes_itself(tmp_path: Path) -> None:
    trainer = nonprivate_trainer(RECIPE)
    assert caching(trainer, None) is trainer

    def plain(data: DataSplits, seed: int, index: int) -> tuple:
        raise AssertionError("not called")

    assert caching(plain, tmp_path) is plain
    assert isinstance(caching(trainer, tmp_path), CachingTrainer)


@pytest.mark.parametrize("target", ["entry", "weights"])
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("device", "unreadable")])
def test_any_bad_cache_file_is_retrained_never_waited_on(
        kind: str, target: str, tmp_path: Path, references: list[DataSplits]) -> None:
    """Every kind of bad content (``tests/unit/core/test_cache_hints.py``) in place of the
    entry or of the weights: the reference is retrained, nothing hangs or fails, and the entry
    is rebuilt where the file can be replaced."""
    trainer = nonprivate_trainer(RECIPE)
    seed = reference_seed(audit_seed=1, index=0)
    trained, _ = CachingTrainer(trainer, tmp_path)(references[0], seed, 0)
    entry, weights = _entry_files(tmp_path)
    plant(entry if target == "entry" else weights, kind)
    again = CachingTrainer(trainer, tmp_path)
    with no_hang():
        model, _ = again(references[0], seed, 0)
    assert again.hits == set() and _same_weights(model, trained)
