"""References pooled over a study's trials (issue 41, item 4): blocks of references, the signals
file each audit keeps, and the pooled record (orchestrator/audit/pooling.py, stored.py).

The attacks read synthetic signals with a known answer: each candidate has a level and a
membership effect of its own, each model adds noise, and a model's value is level + effect x
(the model trained on it) + noise. Pooled references estimate each candidate's IN and OUT
means from more models, so the audit finds more members at 1% FPR; a target whose values
follow a random relabelling (a synthetic null) is found leaking by neither.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.audit.membership import audit_record
from dpsweep.orchestrator.audit.pooling import (
    is_pooled_over,
    pool_groups,
    pool_signals,
    pooled_record,
)
from dpsweep.orchestrator.audit.stored import (
    ModelCells,
    SignalsFileError,
    StoredAudit,
    read_signals,
    write_signals,
)
from dpsweep.trainables.audit.exclusion import SHARED, Exclusion
from dpsweep.trainables.audit.references import (
    BLOCK_MASK,
    AuditSignals,
    ReferencePlan,
    plan_references,
    reference_block,
    reference_seed,
)
from dpsweep.trainables.data.splits import DataSplits, SplitSizes, load_splits

SIZES = SplitSizes(train=300, validation=100, holdout=300, test=297, shadow=800)
K = 4
BLOCKS = 4
NAMES = ("logit", "loss")
MODEL = ModelCells(layers=("fc",), frozen=frozenset(), shadow={}, shadow_excluded=())
#: Seeds of the synthetic populations the pooled and own audits are compared on.
SEEDS = range(6)


@pytest.fixture(scope="module")
def data() -> DataSplits:
    return load_splits(dataset="digits", seed=0, sizes=SIZES)


def _plans(data: DataSplits, blocks: int = BLOCKS) -> list[ReferencePlan]:
    return [plan_references(data=data, kind="online", n_references=K, seed=0, block=b)
            for b in range(blocks)]


def _signals(plan: ReferencePlan, rng: np.random.Generator, *, member: np.ndarray,
             level: np.ndarray, effect: np.ndarray) -> AuditSignals:
    def values(inside: np.ndarray) -> np.ndarray:
        return level + effect * inside + rng.normal(0.0, 1.0, inside.shape)

    t = values(member.astype(float))
    r = np.stack([values(m.astype(float)) for m in plan.in_mask])
    return AuditSignals(plan=plan, target={"logit": t, "loss": -t},
                        population_target={n: np.zeros(0) for n in NAMES},
                        references={"logit": r, "loss": -r},
                        population_references={n: np.zeros((K, 0)) for n in NAMES},
                        records=(), target_signal_seconds=0.0)


def _study(data: DataSplits, seed: int, *, null: bool = False) -> list[AuditSignals]:
    """One synthetic study: the target's signals with each block's references."""
    rng = np.random.default_rng(seed)
    plans = _plans(data)
    n = len(plans[0].candidates)
    level, effect = rng.normal(0.0, 3.0, n), rng.exponential(1.0, n)
    member = plans[0].is_member
    if null:  # the target's values follow a relabelling unrelated to membership
        member = rng.permutation(member)
    return [_signals(p, rng, member=member, level=level, effect=effect) for p in plans]


def _best_tpr(record: dict) -> float:
    return max(e["tpr_at_1pct_fpr"] for e in record["attacks"])


# --- blocks ------------------------------------------------------------------------------------


def test_blocks_audit_the_same_candidates_with_the_halves_of_a_larger_plan(
        data: DataSplits) -> None:
    """Block b's K references are references bK..bK+K-1 of one plan with BLOCKS x K: the same
    candidates, halves and seeds; block 0 is the plan without a block."""
    plans = _plans(data)
    big = plan_references(data=data, kind="online", n_references=K * BLOCKS, seed=0)
    plain = plan_references(data=data, kind="online", n_references=K, seed=0)
    assert np.array_equal(plans[0].in_mask, plain.in_mask)
    for b, plan in enumerate(plans):
        assert plan.block == b
        assert np.array_equal(plan.candidates.indices, big.candidates.indices)
        assert np.array_equal(plan.in_mask, big.in_mask[b * K:(b + 1) * K])
        assert (plan.in_mask.sum(axis=0) == K // 2).all()  # IN for half of its own block
    assert not np.array_equal(plans[0].in_mask, plans[1].in_mask)
    seeds = {reference_seed(audit_seed=0, index=b * K + k) for b in range(BLOCKS)
             for k in range(K)}
    assert len(seeds) == K * BLOCKS


def test_a_trial_id_gives_one_block_and_ids_differ(data: DataSplits) -> None:
    ids = [f"dpsgd_eps3-{i:03d}" for i in range(200)]
    blocks = [reference_block(t) for t in ids]
    assert blocks == [reference_block(t) for t in ids]
    assert len(set(blocks)) == len(ids) and all(0 <= b <= BLOCK_MASK for b in blocks)
    big = plan_references(data=data, kind="online", n_references=K, seed=0, block=blocks[0])
    assert big.block == blocks[0] and big.in_mask.shape == (K, len(big.candidates))


@pytest.mark.parametrize("block", [-1, 1.5, True])
def test_a_bad_block_is_refused(data: DataSplits, block: object) -> None:
    with pytest.raises(UserInputError, match="audit block"):
        plan_references(data=data, kind="online", n_references=K, seed=0,
                        block=block)  # type: ignore[arg-type]


# --- the pooled audit: stronger, and valid under the null ---------------------------------------


def test_pooled_references_find_more_members_than_a_trial_own(data: DataSplits) -> None:
    own, pooled = [], []
    for seed in SEEDS:
        study = _study(data, seed)
        own.append(_best_tpr(audit_record(signals=study[0], model=MODEL, alpha=0.05)))
        signals = pool_signals(study[0], study[1:])
        assert signals.plan.n_references == K * BLOCKS
        record = audit_record(signals=signals, model=MODEL, alpha=0.05, trials=BLOCKS)
        assert record["n_references"] == K * BLOCKS
        assert "pooled over 4 trials of the study" in record["plan_statement"]
        pooled.append(_best_tpr(record))
    # measured: own 0.11-0.15, pooled 0.15-0.23 (median gain 0.05)
    assert statistics.median(p - o for p, o in zip(pooled, own, strict=True)) > 0.02
    assert sum(p > o for p, o in zip(pooled, own, strict=True)) >= len(own) - 1


def test_a_pooled_audit_of_a_target_without_membership_signal_finds_no_leak(
        data: DataSplits) -> None:
    """The attacks that read the pooled references (LiRA, RMIA) find no leak and average chance
    AUC. (The uncalibrated loss threshold, which reads no reference, is left out: its
    family-wise false positives happen at the rate alpha allows, in one of these seeds.)"""
    aucs = []
    for seed in SEEDS:
        study = _study(data, seed, null=True)
        record = audit_record(signals=pool_signals(study[0], study[1:]), model=MODEL,
                              alpha=0.05, trials=BLOCKS)
        calibrated = [e for e in record["attacks"] if not e["attack"].startswith("loss_")]
        assert calibrated and all(e["p_corrected"] > 0.1 for e in calibrated)
        aucs += [e["auc"] for e in calibrated]
    assert abs(statistics.mean(aucs) - 0.5) < 0.03  # measured 0.488


def test_signals_of_other_candidates_do_not_pool(data: DataSplits) -> None:
    study = _study(data, 0)
    other = plan_references(data=data, kind="online", n_references=K, seed=1, block=1,
                            max_candidates=100)
    foreign = _signals(other, np.random.default_rng(0), member=other.is_member,
                       level=np.zeros(len(other.candidates)),
                       effect=np.ones(len(other.candidates)))
    with pytest.raises(ValueError, match="candidates"):
        pool_signals(study[0], [foreign])
    stored = {"a": StoredAudit(study[0], MODEL), "b": StoredAudit(study[1], MODEL),
              "c": StoredAudit(foreign, MODEL)}
    assert pool_groups(stored) == {"a": ["a", "b"], "b": ["b", "a"], "c": ["c"]}


# --- the record ----------------------------------------------------------------------------------


def test_the_pooled_record_keeps_the_trial_own_audit_and_cost(data: DataSplits,
                                                             tmp_path: Path) -> None:
    study = _study(data, 0)
    stored = {f"t{b}": StoredAudit(s, MODEL) for b, s in enumerate(study)}
    own = audit_record(signals=study[0], model=MODEL, alpha=0.05)
    own["references"] = [{"index": k} for k in range(K)]
    own["reference_train_seconds"] = 12.5
    group = ["t0", "t1", "t2", "t3"]
    record = pooled_record(tid="t0", group=group, stored=stored, previous=own, alpha=0.05,
                           scores_out=tmp_path / "scores.npz")
    assert record["references"] == own["references"]
    assert record["reference_train_seconds"] == 12.5
    assert record["pooled"]["trials"] == group and record["pooled"]["own_references"] == K
    assert record["pooled"]["own"]["peak_mia_accuracy"] == own["peak_mia_accuracy"]
    assert record["pooled"]["own"]["n_references"] == K
    assert (tmp_path / "scores.npz").is_file() and record["scores_file"] == "scores.npz"
    assert is_pooled_over(record, group) and not is_pooled_over(record, group[:2])
    assert not is_pooled_over(own, group)
    # pooled again (a resume with one more trial): the trial's own audit stays its own
    again = pooled_record(tid="t0", group=group[:3], stored=stored, previous=record,
                          alpha=0.05, scores_out=tmp_path / "scores.npz")
    assert again["pooled"]["own"] == record["pooled"]["own"]
    assert again["n_references"] == 3 * K


# --- the signals file --------------------------------------------------------------------------


def _model_with_shadow(n: int) -> ModelCells:
    scores = np.linspace(0.0, 1.0, n)
    return ModelCells(
        layers=("conv", "fc"), frozen=frozenset({"conv"}),
        shadow={("fc", "shadow_classifier:ir"): (scores, {"index": 1, "signal": "sorted IR",
                                                          "rule": "P(member) >= 0.5",
                                                          "threshold": 0.5})},
        shadow_excluded=(Exclusion(layer="conv", index=0, attack="shadow_classifier:ir",
                                   signal="sorted IR", status=SHARED, reason="frozen"),))


def test_the_signals_file_reads_back_what_the_audit_scored(data: DataSplits,
                                                           tmp_path: Path) -> None:
    study = _study(data, 0)
    model = _model_with_shadow(len(study[1].plan.candidates))
    path = tmp_path / "audit_signals.npz"
    write_signals(path, signals=study[1], model=model)
    back = read_signals(path, plan=study[1].plan)
    for name in NAMES:
        assert np.array_equal(back.signals.target[name], study[1].target[name])
        assert np.array_equal(back.signals.references[name], study[1].references[name])
    assert back.model.layers == model.layers and back.model.frozen == model.frozen
    assert back.model.shadow_excluded == model.shadow_excluded
    (key, (scores, meta)), = back.model.shadow.items()
    assert key == ("fc", "shadow_classifier:ir") and meta["threshold"] == 0.5
    assert np.array_equal(scores, model.shadow[key][0])
    # the record scored from the file is the one scored from memory
    a = audit_record(signals=study[1], model=model, alpha=0.05)
    b = audit_record(signals=back.signals, model=back.model, alpha=0.05)
    assert a["attacks"] == b["attacks"] and a["excluded"] == b["excluded"]


def test_a_signals_file_that_is_not_this_plan_or_is_crafted_is_refused(
        data: DataSplits, tmp_path: Path) -> None:
    study = _study(data, 0)
    path = tmp_path / "audit_signals.npz"
    write_signals(path, signals=study[1], model=MODEL)
    with pytest.raises(SignalsFileError, match="block"):
        read_signals(path, plan=study[2].plan)
    fewer_candidates = plan_references(data=data, kind="online", n_references=K, seed=0,
                                       block=1, max_candidates=100)
    with pytest.raises(SignalsFileError, match="'pool_index' has shape"):
        read_signals(path, plan=fewer_candidates)
    other = dataclasses.replace(study[1].plan, candidates=dataclasses.replace(
        study[1].plan.candidates, indices=study[1].plan.candidates.indices + 1))
    with pytest.raises(SignalsFileError, match="candidates are not the plan's"):
        read_signals(path, plan=other)
    fewer = dataclasses.replace(study[1].plan, in_mask=study[1].plan.in_mask[:3],
                                train_rows=study[1].plan.train_rows[:3])
    with pytest.raises(SignalsFileError, match="'references' has shape"):
        read_signals(path, plan=fewer)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(SignalsFileError, match="not a readable npz"):
        read_signals(tmp_path / "junk.npz", plan=study[1].plan)
    # an object array (a pickle) is never loaded
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["names"] = np.array(list(NAMES), dtype=object)
    np.savez(tmp_path / "pickled.npz", **arrays)
    with pytest.raises(SignalsFileError):
        read_signals(tmp_path / "pickled.npz", plan=study[1].plan)
    arrays["names"] = np.array(["logit", "logit"])
    np.savez(tmp_path / "repeated.npz", **arrays)
    with pytest.raises(SignalsFileError, match="repeat"):
        read_signals(tmp_path / "repeated.npz", plan=study[1].plan)


# --- the sweep's pooling step ----------------------------------------------------------------


class _Records:
    """What ``pool_audits`` reads and amends of the sweep's records."""

    def __init__(self, rows: dict[str, dict]) -> None:
        self.rows = rows
        self.amended: list[str] = []

    def amend(self, tid: str, columns: dict) -> None:
        self.rows[tid].update(columns)
        self.amended.append(tid)


def test_the_sweep_pools_each_study_and_leaves_a_tampered_file_out(
        data: DataSplits, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from dpsweep.core import layout
    from dpsweep.core.storage import atomic_write_json
    from dpsweep.core.vocabulary import OK
    from dpsweep.orchestrator.audit.membership import row_audit_columns
    from dpsweep.orchestrator.rundir import RunDir
    from dpsweep.orchestrator.sweep.pooling import pool_audits

    ids = ["s-000", "s-001", "s-002"]
    rng = np.random.default_rng(0)
    n = len(_plans(data, 1)[0].candidates)
    level, effect = rng.normal(0.0, 3.0, n), rng.exponential(1.0, n)
    run = RunDir.create(tmp_path / "run", config_text="")
    try:
        rows = {}
        for tid in ids:
            plan = plan_references(data=data, kind="online", n_references=K, seed=0,
                                   block=reference_block(tid))
            signals = _signals(plan, rng, member=plan.is_member, level=level, effect=effect)
            trial = run.trial_dir(tid)
            trial.mkdir(parents=True)
            write_signals(trial / layout.AUDIT_SIGNALS, signals=signals, model=MODEL)
            record = audit_record(signals=signals, model=MODEL, alpha=0.05,
                                  scores_out=trial / layout.AUDIT_SCORES)
            record.update(references=[{"index": k} for k in range(K)],
                          reference_train_seconds=1.0)
            atomic_write_json(trial / layout.AUDIT, record)
            run.record_trial(tid)
            rows[tid] = {"status": OK, "study": "s", **row_audit_columns(record)}
        signals_file = run.trial_dir(ids[2]) / layout.AUDIT_SIGNALS
        signals_file.write_bytes(signals_file.read_bytes()[:-1])  # not what the audit wrote
        audit = SimpleNamespace(enabled=True, share_references="study", references="online",
                                reference_models=K, max_candidates=0, alpha=0.05, seed=0,
                                layer_probes=False)
        context = SimpleNamespace(cfg=SimpleNamespace(audit=audit), run=run)
        records = _Records(rows)
        assert pool_audits(context=context, records=records, data=data, quiet=False) == 2
        out = capsys.readouterr().out
        assert f"{ids[2]}: its own references only" in out and "SHA-256 differs" in out
        assert sorted(records.amended) == ids[:2]
        for tid in ids[:2]:
            path = run.verify(f"{layout.TRIALS}/{tid}/{layout.AUDIT}")  # in the manifest
            record = json.loads(path.read_text())
            assert record["pooled"]["trials"] == [tid, *(t for t in ids[:2] if t != tid)]
            assert record["n_references"] == 2 * K
            assert records.rows[tid]["peak_mia_accuracy"] == record["peak_mia_accuracy"]
            run.verify(f"{layout.TRIALS}/{tid}/{layout.AUDIT_SCORES}")
        # nothing new: nothing written
        assert pool_audits(context=context, records=records, data=data, quiet=True) == 0
        audit.share_references = "none"
        assert pool_audits(context=context, records=records, data=data, quiet=True) == 0
    finally:
        run.release()
