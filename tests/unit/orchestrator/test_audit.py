"""The audit of one model (orchestrator/audit/membership.py): every layer and attack with its
statistics, the Holm-corrected peak over distinct attacks only, a leak found on an overfit model
and none on a model that never saw the candidates, the row columns, split sizes refused before
any trial runs, the per-candidate scores file and the re-analysis script that reproduces the
record from it (its ``main``, in this process), and references reused from the run's cache with
progress lines."""

from __future__ import annotations

import json
import math
import runpy
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import rankdata
from sklearn.metrics import roc_auc_score

from dpsweep.core.errors import UserInputError
from dpsweep.core.layout import AUDIT, AUDIT_SCORES, CACHE, TRIALS
from dpsweep.core.storage import atomic_write_json
from dpsweep.orchestrator.audit.membership import (
    OUTPUT,
    SCORES_FORMAT,
    SHADOW_CLASSIFIER,
    AuditSettings,
    audit_model,
    check_settings,
    row_audit_columns,
    trial_audit_paths,
)
from dpsweep.trainables.audit.cache import NAMESPACE
from dpsweep.trainables.audit.references import (
    NonPrivateRecipe,
    nonprivate_trainer,
    plan_references,
    reference_block,
    reference_data,
    train_nonprivate,
)
from dpsweep.trainables.data.splits import DataSplits, SplitSizes, load_splits
from dpsweep.trainables.models.networks import LayeredModel

SIZES = SplitSizes(train=300, validation=100, holdout=300, test=297, shadow=800)
#: Overfits 300 digits (train loss ~1e-3) in a few seconds on one core.
RECIPE = NonPrivateRecipe(epochs=100, lr=3e-3, batch_size=32)
SETTINGS = AuditSettings(references="online", reference_models=4, max_candidates=0, alpha=0.05,
                         seed=3)
#: The attacks every layer carries (the output row carries the logit and loss signals).
LAYER_ATTACKS = {"lira_online:grad_norm", "lira_pooled:grad_norm", "lira_offline:grad_norm",
                 "rmia:grad_norm", "lira_online:probe_loss", "lira_pooled:probe_loss",
                 "lira_offline:probe_loss", "rmia:probe_loss", f"{SHADOW_CLASSIFIER}:ir"}
#: The output row: LiRA on both output signals, RMIA once (logit and loss give it one
#: probability), the loss threshold.
OUTPUT_ATTACKS = {"lira_online:logit", "lira_pooled:logit", "lira_offline:logit", "rmia:logit",
                  "lira_online:loss", "lira_pooled:loss", "lira_offline:loss",
                  "loss_threshold:loss"}
#: digits_cnn's layers.
LAYERS = ("conv1", "conv2", "fc1", "fc2")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def data() -> DataSplits:
    torch.set_num_threads(1)
    return load_splits(dataset="digits", seed=0, sizes=SIZES)


@pytest.fixture(scope="module")
def audit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory's layout for the audits to write into: trials/<id>/ and cache/."""
    return tmp_path_factory.mktemp("audit_run")


def _audit_into(run: Path, trial_id: str, *, block_of: str | None = None,
                **kwargs: object) -> dict:
    """audit_model with the files a sweep gives it, audit.json written like the trial's;
    ``block_of``: train the references of that trial id's block instead of its own."""
    trial = run / TRIALS / trial_id
    paths = trial_audit_paths(trial)
    if block_of is not None:
        paths["block"] = reference_block(block_of)
    record = audit_model(**kwargs, **paths)  # type: ignore[arg-type]
    atomic_write_json(trial / AUDIT, record)
    return record


@pytest.fixture(scope="module")
def leaky(data: DataSplits, audit_run: Path) -> tuple[LayeredModel, dict]:
    model, _ = train_nonprivate(data=data, recipe=RECIPE, seed=12345)
    return model, _audit_into(audit_run, "leaky", target=model, data=data, settings=SETTINGS,
                              trainer=nonprivate_trainer(RECIPE))


@pytest.fixture(scope="module")
def null_audit(data: DataSplits, audit_run: Path,
               leaky: tuple[LayeredModel, dict]) -> tuple[dict, list[str]]:
    """A model trained on public pool data only: no candidate is its member. Audited after
    ``leaky`` in the same run with the same plan (its references' block taken from
    ``leaky``), recipe and data, so the same references."""
    del leaky
    pool = reference_data(plan_references(data=data, kind="offline", n_references=4, seed=9),
                          data, index=0)
    model, _ = train_nonprivate(data=pool, recipe=RECIPE, seed=777)
    lines: list[str] = []
    record = _audit_into(audit_run, "null", target=model, data=data, settings=SETTINGS,
                         trainer=nonprivate_trainer(RECIPE), progress=lines.append,
                         block_of="leaky")
    return record, lines


@pytest.fixture(scope="module")
def null_record(null_audit: tuple[dict, list[str]]) -> dict:
    return null_audit[0]


def test_every_layer_carries_every_attack_with_intervals(leaky: tuple[LayeredModel, dict]
                                                         ) -> None:
    model, record = leaky
    by_layer: dict[str, set[str]] = {}
    for e in record["attacks"]:
        by_layer.setdefault(e["layer"], set()).add(e["attack"])
        lo, hi = e["accuracy_ci"]
        assert lo <= e["accuracy"] <= hi and hi - lo < 0.2
        lo, hi = e["auc_ci"]
        assert lo <= e["auc"] <= hi
        for label in ("1pct", "0.1pct"):
            lo, hi = e[f"tpr_at_{label}_fpr_ci"]
            assert 0 <= lo <= e[f"tpr_at_{label}_fpr"] <= hi <= 1
        assert e["p_value"] <= e["p_corrected"] <= 1
        assert e["significant"] == (e["p_corrected"] < SETTINGS.alpha)
        assert e["n_members"] == e["n_nonmembers"] == 300
    assert tuple(model.layer_names) == LAYERS
    for layer in model.layer_names:
        assert by_layer[layer] == LAYER_ATTACKS, (layer, by_layer[layer])
    assert by_layer[OUTPUT] == OUTPUT_ATTACKS
    assert record["mode"] == "online" and record["n_references"] == 4
    assert len(record["references"]) == 4 and record["n_candidates"] == 600


def test_overfit_model_leaks_and_the_peak_is_the_leader(leaky: tuple[LayeredModel, dict]
                                                        ) -> None:
    _, record = leaky
    assert record["leak_detected"] and record["leak_p_value"] < 1e-6
    peak = max(record["attacks"], key=lambda e: e["accuracy"])
    assert record["peak_mia_accuracy"] == pytest.approx(peak["accuracy"])
    assert record["peak_mia_accuracy"] > 0.6
    assert record["peak_mia_upper"] > record["peak_mia_accuracy"]
    assert record["loss_attack_accuracy"] > 0.55


def test_a_model_that_never_saw_the_candidates_shows_no_leak(null_record: dict) -> None:
    assert not null_record["leak_detected"], null_record["leak_p_value"]
    assert null_record["leak_p_value"] > SETTINGS.alpha
    # The peak over ~25 attacks is biased up, its simultaneous bound still covers chance.
    assert null_record["peak_mia_upper"] >= 0.5
    assert not any(e["significant"] for e in null_record["attacks"])


def test_row_columns_summarise_without_roc_points(leaky: tuple[LayeredModel, dict]) -> None:
    _, record = leaky
    row = row_audit_columns(record)
    layers = json.loads(row["mia_layers"])
    assert len(layers) == len(record["attacks"])
    assert all("roc_fpr" not in e and "roc_tpr" not in e for e in layers)
    assert row["leak_detected"] is True and row["audit_mode"] == "online"
    assert row["peak_layer"] == record["peak_layer"]
    assert isinstance(row["peak_layer_index"], int)
    assert math.isfinite(row["audit_seconds"]) and row["audit_seconds"] > 0
    json.dumps(record)  # audit.json is plain JSON


def test_split_sizes_the_audit_cannot_plan_are_refused_with_the_field() -> None:
    tiny = load_splits(dataset="digits", seed=0,
                       sizes=SplitSizes(train=300, validation=100, holdout=1, test=297,
                                        shadow=800))
    with pytest.raises(UserInputError) as err:
        check_settings(tiny, SETTINGS)
    assert "holdout" in str(err.value) or "audit" in str(err.value)


def test_a_leaky_model_contradicts_a_small_claim_and_a_null_model_does_not(
        leaky: tuple[LayeredModel, dict], null_record: dict) -> None:
    """The ROC check against a claim: an overfit (non-private) model measured as if it claimed
    epsilon 0.1 is contradicted; a model that never saw the candidates is consistent with it."""
    _, record = leaky
    claimed = {"epsilon_upper": 0.1, "delta": 1e-5, "dp_valid": True}
    row = row_audit_columns(record, row=claimed)
    assert row["mia_epsilon_lower"] > 0.1
    assert row["mia_pointwise_violations"] > 0
    assert row["audit_contradicts"] is True
    clean = row_audit_columns(null_record, row=claimed)
    assert clean["mia_epsilon_lower"] <= 0.1
    assert "audit_contradicts" not in clean
    # Against a generous claim the leaky model is consistent too; an invalid claim is never
    # "contradicted" (it claims nothing), and a row without a finite claim is not checked.
    assert row_audit_columns(record, row={**claimed, "epsilon_upper": 50.0}).get(
        "audit_contradicts") is None
    assert "audit_contradicts" not in row_audit_columns(record,
                                                        row={**claimed, "dp_valid": False})
    unchecked = row_audit_columns(record, row={"epsilon_upper": math.inf, "delta": 1e-5})
    assert math.isnan(unchecked["mia_epsilon_lower"])
    assert unchecked["mia_pointwise_violations"] == -1


def test_representation_leakage_grows_with_depth(leaky: tuple[LayeredModel, dict]) -> None:
    """The probe-loss signal reads each layer's representation: on an overfit model the deepest
    hidden layer leaks clearly more than the first (measured here: AUC 0.52 at conv1, 0.71 at
    fc2), while every layer's gradient norm carries the same output residual."""
    _, record = leaky
    auc = {e["layer"]: e["auc"] for e in record["attacks"]
           if e["attack"] == "lira_online:probe_loss"}
    layers = [e["layer"] for e in sorted(record["attacks"], key=lambda e: e["index"])
              if e["attack"] == "lira_online:probe_loss"]
    first, last = layers[0], layers[-1]
    assert auc[last] > auc[first] + 0.1, auc
    first_entry = next(e for e in record["attacks"]
                       if e["layer"] == first and e["attack"] == "lira_online:probe_loss")
    assert first_entry["auc_ci"][0] < auc[last]


def test_a_probe_set_too_small_to_fit_is_refused_with_the_field(data: DataSplits) -> None:
    from dpsweep.trainables.audit.probes import MIN_PER_CLASS, probe_set_of, probe_signals
    from dpsweep.trainables.audit.references import subset

    tiny = subset(data.validation, np.arange(MIN_PER_CLASS * data.num_classes - 1))
    with pytest.raises(UserInputError) as err:
        probe_signals(probe_set=tiny, num_classes=data.num_classes)
    assert "audit.layer_probes" in str(err.value)
    chosen = probe_set_of(data.validation, seed=3)
    assert len(chosen) == len(data.validation)  # every one of 100 (< the 1000 cap)
    assert set(chosen.indices.tolist()).isdisjoint(data.train.indices.tolist())


# --- distinct attacks, the scores file, its re-analysis, the reference cache ------------------


def _stored(run: Path, trial_id: str) -> dict[str, np.ndarray]:
    with np.load(run / TRIALS / trial_id / AUDIT_SCORES, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def test_holm_counts_each_distinct_attack_once(leaky: tuple[LayeredModel, dict],
                                               audit_run: Path) -> None:
    """RMIA on the loss would repeat RMIA on the logit (one probability): it is not run, so
    the family is 4 layers x 9 attacks + 8 output attacks = 44, no two the same test."""
    _, record = leaky
    assert record["combined"]["n_tests"] == len(record["attacks"]) == 4 * 9 + 8
    raw = np.array([e["p_value"] for e in record["attacks"]])
    # Holm's smallest adjusted p-value is m x the smallest raw one (capped at 1)
    assert record["leak_p_value"] == pytest.approx(min(1.0, 44 * raw.min()), rel=1e-12)
    scores = _stored(audit_run, "leaky")["scores"]
    ranks = np.stack([rankdata(row) for row in scores])
    assert len(np.unique(ranks, axis=0)) == len(ranks)  # no attack ranks like another


def test_the_scores_file_holds_every_candidate_as_the_statistics_saw_it(
        leaky: tuple[LayeredModel, dict], audit_run: Path, data: DataSplits) -> None:
    _, record = leaky
    stored = _stored(audit_run, "leaky")
    assert str(stored["format"]) == SCORES_FORMAT
    assert stored["scores"].dtype == np.float32 and stored["scores"].shape == (44, 600)
    member = stored["is_member"].astype(bool)
    assert member.sum() == 300 and (~member).sum() == 300
    # members are the target's training examples, non-members holdout examples (pool indices)
    assert set(stored["pool_index"][member]) <= set(data.train.indices.tolist())
    assert set(stored["pool_index"][~member]) <= set(data.holdout.indices.tolist())
    assert len(set(stored["pool_index"].tolist())) == 600
    path = audit_run / TRIALS / "leaky" / AUDIT_SCORES
    assert record["scores_file"] == AUDIT_SCORES
    # float32 scores barely compress; the indices and labels do: below their raw bytes
    assert 44 * 600 * 4 // 2 < path.stat().st_size < 44 * 600 * 4 + 600 * (8 + 1)
    rows = {(str(la), str(at)): i for i, (la, at)
            in enumerate(zip(stored["layer"], stored["attack"], strict=True))}
    for e in record["attacks"]:  # an independent AUC (scikit-learn) of the stored scores
        auc = roc_auc_score(member, stored["scores"][rows[(e["layer"], e["attack"])]])
        assert auc == pytest.approx(e["auc"], abs=1e-12), (e["layer"], e["attack"])


def _reanalyse(argv: list[str], capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """docs/reanalyse_audit.py's ``main`` run in this process (a unit test starts no process;
    the script is numpy and pandas only): its exit code, stdout and stderr."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends the repository
    main = runpy.run_path(str(ROOT / "docs" / "reanalyse_audit.py"))["main"]
    capsys.readouterr()
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_reanalysis_script_reproduces_the_record(
        leaky: tuple[LayeredModel, dict], audit_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, record = leaky
    table_csv = tmp_path / "table.csv"
    rc, out, err = _reanalyse([str(audit_run), "leaky", "--csv", str(table_csv)], capsys,
                              monkeypatch)
    assert rc == 0, out + err
    assert "44 layer x attack entries" in out and "reproduced to 1e-09" in out
    table = pd.read_csv(table_csv)
    assert len(table) == len(record["attacks"])
    for column in ("auc", "tpr_at_1pct_fpr", "accuracy"):
        assert np.abs(table[column] - table[f"{column}_recomputed"]).max() <= 1e-9, column
    peak = table[(table["layer"] == record["peak_layer"])
                 & (table["attack"] == record["peak_attack"])].iloc[0]
    assert peak["accuracy_recomputed"] == pytest.approx(record["peak_mia_accuracy"], abs=1e-12)
    # a scores file that is not the one audit.json recorded is refused (exit 2)
    forged = audit_run / TRIALS / "forged"
    shutil.copytree(audit_run / TRIALS / "leaky", forged)
    stored = _stored(audit_run, "leaky")
    stored["scores"][0, 0] += 1.0
    np.savez_compressed(forged / AUDIT_SCORES, **stored)
    rc, _, err = _reanalyse([str(audit_run), "forged"], capsys, monkeypatch)
    assert rc == 2 and "SHA-256" in err


def test_references_are_reused_from_the_run_cache_with_progress(
        leaky: tuple[LayeredModel, dict], null_audit: tuple[dict, list[str]],
        audit_run: Path) -> None:
    _, first = leaky
    record, lines = null_audit
    assert not any(r["cached"] for r in first["references"])
    assert all(r["cached"] for r in record["references"])
    # the cached references are the first audit's: the same seeds and training-set sizes
    assert [(r["seed"], r["n_train"], r["train_seconds"]) for r in record["references"]] == \
        [(r["seed"], r["n_train"], r["train_seconds"]) for r in first["references"]]
    assert lines[0] == "audit: online plan, 4 references, 600 candidates"
    for k in range(4):
        assert any(f"reference {k + 1}/4 loaded from the cache" in line for line in lines)
    assert lines[-1].startswith("audit: 44 attacks scored")
    assert len(list((audit_run / CACHE / NAMESPACE).glob("*.safetensors"))) == 4
    assert record["plan_statement"].startswith("Online audit, 4 reference models")
    assert "16 online references reached 0.18 (0.14-0.20)" in record["plan_statement"]


def test_the_run_manifest_vouches_for_the_scores_file(leaky: tuple[LayeredModel, dict],
                                                      audit_run: Path, tmp_path: Path) -> None:
    """record_trial lists audit_scores.npz (core.layout.TRIAL_FILES) with its SHA-256, like
    every trial record, and a read of an edited one is refused."""
    from dpsweep.orchestrator.rundir import RunDir

    run = RunDir.create(tmp_path / "run", config_text="")
    try:
        shutil.copytree(audit_run / TRIALS / "leaky", run.trial_dir("leaky"))
        rels = run.record_trial("leaky")
        rel = f"{TRIALS}/leaky/{AUDIT_SCORES}"
        assert rel in rels and rels.index(rel) < rels.index(f"{TRIALS}/leaky/{AUDIT}")
        assert run.manifest["files"][rel]["sha256"] == leaky[1]["scores_sha256"]
        run.verify(rel)
        path = run.path / rel
        path.write_bytes(path.read_bytes()[:-1])
        with pytest.raises(UserInputError):
            run.verify(rel)
    finally:
        run.release()
