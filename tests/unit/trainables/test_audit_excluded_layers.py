"""The audit's excluded cells (trainables/audit/exclusion.py, orchestrator/audit/membership.py):
signals and representations identical in the target and every reference are reported frozen
and shared, non-finite scores are reported with which layer, attack and why, the rest is scored
with finite numbers and alone makes the peak and the Holm family; an audit with no scorable
cell is a record without a peak and with the reason, never an exception."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dpsweep.orchestrator.audit.membership import (
    OUTPUT,
    SHADOW_CLASSIFIER,
    audit_signals,
    row_audit_columns,
)
from dpsweep.trainables.audit.classifier import ShadowClassifier
from dpsweep.trainables.audit.exclusion import (
    EXCLUDED,
    NON_FINITE,
    SCORED,
    SHARED,
    SHARED_FROZEN,
    SHARED_IDENTICAL,
    UNSCORABLE,
    frozen_layers,
    identical_signals,
)
from dpsweep.trainables.audit.references import AuditSignals, ReferencePlan, plan_references
from dpsweep.trainables.data.splits import DataSplits, SplitSizes, load_splits
from dpsweep.trainables.models.networks import LayeredModel, digits_cnn

SIZES = SplitSizes(train=40, validation=60, holdout=40, test=30, shadow=120)
K = 4
#: Audited candidates: 40 members and 40 non-members.
N_CANDIDATES = 80
#: The target's candidates whose ``probe_loss:conv2`` is NaN, and the one whose
#: ``probe_loss:fc1`` is +inf in the target and every reference (a probe probability that
#: underflowed in all of them).
NAN_ROWS = (3, 17, 60)
INF_ROW = 5
#: Signals the synthetic audit carries: conv1 is frozen (no gradient norm).
NAMES = ("grad_norm:conv2", "grad_norm:fc1", "grad_norm:fc2", "probe_loss:conv1",
         "probe_loss:conv2", "probe_loss:fc1", "probe_loss:fc2", "logit", "loss")
SHADOW = f"{SHADOW_CLASSIFIER}:ir"


@pytest.fixture(scope="module")
def data() -> DataSplits:
    torch.set_num_threads(1)
    return load_splits(dataset="digits", seed=0, sizes=SIZES)


@pytest.fixture(scope="module")
def plan(data: DataSplits) -> ReferencePlan:
    return plan_references(data=data, kind="offline", n_references=K, seed=0)


def _target() -> LayeredModel:
    """digits_cnn with conv1 frozen, as a pretrained backbone would be."""
    torch.manual_seed(0)
    model = digits_cnn()
    model.blocks["conv1"].requires_grad_(False)
    return model.eval()


def _references(target: LayeredModel, *, share: tuple[str, ...]) -> list[LayeredModel]:
    """Copies of the target whose layers outside ``share`` are perturbed (each its own way)."""
    refs = []
    for k in range(K):
        ref = copy.deepcopy(target)
        generator = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for name, block in ref.blocks.items():
                if name not in share:
                    for p in block.parameters():
                        p.add_(0.1 * torch.randn(p.shape, generator=generator))
        refs.append(ref)
    return refs


def _classifier(plan: ReferencePlan, refs: list[LayeredModel]) -> ShadowClassifier:
    """The shadow classifier after reading every reference, as the audit's trainer wrap does."""
    classifier = ShadowClassifier(plan, classes=10, seed=0)
    train = classifier.wrap(lambda data, seed, index: (refs[index], 0.0))
    for k in range(K):
        train(None, 0, k)  # type: ignore[arg-type]
    return classifier


def _signals(plan: ReferencePlan, *, identical: bool) -> AuditSignals:
    """Per-candidate signals (members lower losses and gradient norms, higher logits), with
    ``probe_loss:conv1`` identical in every model, NaN in the target's ``probe_loss:conv2`` and
    one infinity shared by all models in ``probe_loss:fc1``; ``identical``: every signal the
    same in every model."""
    rng = np.random.default_rng(1)
    n, m = len(plan.candidates), len(plan.population)
    member = np.r_[plan.is_member, np.zeros(m)]
    target, refs = {}, {}
    for name in NAMES:
        base = 1.5 + rng.gamma(2.0, 0.5, size=n + m)
        shift = (1 if name == "logit" else -1) * 0.4 * member
        own = base + shift + 0.1 * rng.normal(size=n + m)
        others = base + 0.1 * rng.normal(size=(K, n + m))
        if identical or name == "probe_loss:conv1":
            own, others = base, np.broadcast_to(base, (K, n + m)).copy()
        if name == "probe_loss:conv2" and not identical:
            own[list(NAN_ROWS)] = np.nan
        if name == "probe_loss:fc1" and not identical:
            own[INF_ROW], others[:, INF_ROW] = np.inf, np.inf
        target[name], refs[name] = own, others
    return AuditSignals(plan=plan, target={k: v[:n] for k, v in target.items()},
                        population_target={k: v[n:] for k, v in target.items()},
                        references={k: v[:, :n] for k, v in refs.items()},
                        population_references={k: v[:, n:] for k, v in refs.items()},
                        records=(), target_signal_seconds=0.0)


@pytest.fixture(scope="module")
def mixed(plan: ReferencePlan) -> dict:
    target = _target()
    classifier = _classifier(plan, _references(target, share=("conv1",)))
    return audit_signals(signals=_signals(plan, identical=False), classifier=classifier,
                         target=target, alpha=0.05)


def _excluded(record: dict) -> dict[tuple[str, str], dict]:
    return {(e["layer"], e["attack"]): e for e in record["excluded"]}


def test_a_frozen_layer_shared_with_every_reference_is_reported_not_scored(mixed: dict
                                                                            ) -> None:
    excluded = _excluded(mixed)
    conv1 = {a: e for (layer, a), e in excluded.items() if layer == "conv1"}
    assert set(conv1) == {"lira_offline:probe_loss", "rmia:probe_loss", SHADOW}
    assert all(e["status"] == SHARED and e["reason"].startswith(SHARED_FROZEN)
               for e in conv1.values())
    assert ("'probe_loss:conv1' is bit-identical in the target and all 4 references on the "
            f"{N_CANDIDATES + SIZES.shadow} examples") in conv1["rmia:probe_loss"]["reason"]
    assert "output is bit-identical" in conv1[SHADOW]["reason"]
    status = {s["layer"]: s for s in mixed["layers"]}
    assert status["conv1"]["status"] == SHARED and status["conv1"]["frozen"]
    assert status["conv1"]["n_scored"] == 0 and status["conv1"]["reasons"]
    assert not any(e["layer"] == "conv1" for e in mixed["attacks"])


def test_non_finite_scores_are_excluded_with_layer_attack_and_reason(mixed: dict) -> None:
    excluded = _excluded(mixed)
    nan = excluded[("conv2", "lira_offline:probe_loss")]
    assert nan["status"] == NON_FINITE and nan["signal"] == "probe_loss:conv2"
    assert f"{len(NAN_ROWS)} NaN" in nan["reason"]
    assert f"at {len(NAN_ROWS)} of the target's {N_CANDIDATES} candidates" in nan["reason"]
    # an infinity at one candidate in every model leaves offline LiRA no finite reference
    # value there (its mean is NaN): that cell goes, RMIA on the same signal is scored
    inf = excluded[("fc1", "lira_offline:probe_loss")]
    assert inf["status"] == NON_FINITE and "1 NaN" in inf["reason"]
    scored = {(e["layer"], e["attack"]) for e in mixed["attacks"]}
    assert ("fc1", "rmia:probe_loss") in scored
    assert ("conv2", SHADOW) in scored and ("conv2", "lira_offline:grad_norm") in scored
    status = {s["layer"]: s["status"] for s in mixed["layers"]}
    assert status == {"conv1": SHARED, "conv2": "partly_scored", "fc1": "partly_scored",
                      "fc2": SCORED, OUTPUT: SCORED}


def test_the_peak_and_the_family_range_over_scored_cells_only(mixed: dict) -> None:
    entries = mixed["attacks"]
    assert entries and mixed["n_scored"] == len(entries) == mixed["combined"]["n_tests"]
    assert not {(e["layer"], e["attack"]) for e in entries} & set(_excluded(mixed))
    for e in entries:
        assert all(math.isfinite(v) for v in (e["accuracy"], e["auc"], e["p_value"],
                                              e["p_corrected"]))
    peak = max(entries, key=lambda e: (e["accuracy"], -e["p_value"]))
    assert (mixed["peak_layer"], mixed["peak_attack"]) == (peak["layer"], peak["attack"])
    assert mixed["peak_mia_accuracy"] <= mixed["peak_mia_upper"] <= 1
    assert mixed["peak_absent_reason"] is None
    row = row_audit_columns({**mixed, "reference_train_seconds": 0.0})
    cells = json.loads(row["mia_layers"])
    assert len(cells) == len(entries) + len(mixed["excluded"])
    assert {c["status"] for c in cells} == {SCORED, SHARED, NON_FINITE}
    json.dumps(mixed, allow_nan=False)  # audit.json stays plain JSON


def test_an_audit_with_nothing_to_score_reports_why_and_has_no_peak(plan: ReferencePlan,
                                                                    tmp_path: Path) -> None:
    target = _target()
    classifier = _classifier(plan, _references(target, share=tuple(target.layer_names)))
    record = audit_signals(signals=_signals(plan, identical=True), classifier=classifier,
                           target=target, alpha=0.05, scores_out=tmp_path / "scores.npz")
    with np.load(tmp_path / "scores.npz", allow_pickle=False) as stored:
        assert stored["scores"].shape == (0, N_CANDIDATES)  # no row: nothing was scored
    assert record["attacks"] == [] and record["n_scored"] == 0 and record["combined"] is None
    assert record["peak_mia_accuracy"] is None and record["peak_mia_upper"] is None
    assert record["peak_absent_reason"].startswith("no layer x attack could be scored")
    assert {s["status"] for s in record["layers"]} == {SHARED}
    frozen = {s["layer"]: s["frozen"] for s in record["layers"]}
    assert frozen == {"conv1": True, "conv2": False, "fc1": False, "fc2": False, OUTPUT: False}
    reasons = {e["layer"]: e["reason"] for e in record["excluded"]}
    assert reasons["conv1"].startswith(SHARED_FROZEN)
    assert reasons["fc2"].startswith(SHARED_IDENTICAL)
    row = row_audit_columns({**record, "reference_train_seconds": 0.0},
                            row={"epsilon_upper": 1.0, "delta": 1e-5, "dp_valid": True})
    assert math.isnan(row["peak_mia_accuracy"]) and math.isnan(row["peak_mia_upper"])
    assert row["peak_layer"] == "" and row["peak_layer_index"] == -1
    assert math.isnan(row["mia_epsilon_lower"]) and row["mia_pointwise_violations"] == -1
    assert len(json.loads(row["mia_layers"])) == len(record["excluded"])


def test_frozen_layers_and_identical_signals_read_what_they_say(plan: ReferencePlan) -> None:
    target = _target()
    assert frozen_layers(target) == {"conv1"}
    target.blocks["conv2"].requires_grad_(False)
    assert frozen_layers(target) == {"conv1", "conv2"}
    target.blocks["conv1"].requires_grad_(True)
    assert frozen_layers(target) == set()  # conv2 follows a layer that trains
    target.blocks["conv1"].requires_grad_(False)
    target.root = torch.nn.Parameter(torch.zeros(1))  # outside the layers: it may act anywhere
    assert frozen_layers(target) == set()
    target.root.requires_grad_(False)
    assert frozen_layers(target) == {"conv1", "conv2"}
    assert identical_signals(_signals(plan, identical=False)) == {"probe_loss:conv1"}
    assert identical_signals(_signals(plan, identical=True)) == set(NAMES)


def test_an_attack_that_refuses_its_input_is_excluded_with_the_error(plan: ReferencePlan
                                                                     ) -> None:
    """No finite reference value of a signal leaves LiRA no variance to fit; a reference whose
    last layer computes NaN gives the shadow classifier features scikit-learn refuses: both
    cells are excluded with the error, the rest of the audit is scored."""
    target = _target()
    refs = _references(target, share=("conv1",))
    with torch.no_grad():
        refs[0].blocks["fc2"][0].weight.fill_(math.nan)
    signals = _signals(plan, identical=False)
    signals.references["probe_loss:fc2"][:] = np.nan
    signals.population_references["probe_loss:fc2"][:] = np.nan
    signals.target["grad_norm:fc2"][:] = np.nan  # and fc2 has no cell left to score
    record = audit_signals(signals=signals, classifier=_classifier(plan, refs), target=target,
                           alpha=0.05)
    excluded = _excluded(record)
    lira = excluded[("fc2", "*:probe_loss")]
    assert lira["status"] == UNSCORABLE and "variance" in lira["reason"]
    shadow = excluded[("fc2", SHADOW)]
    assert shadow["status"] == UNSCORABLE and "NaN" in shadow["reason"]
    assert excluded[("fc2", "lira_offline:grad_norm")]["status"] == NON_FINITE
    status = {s["layer"]: s["status"] for s in record["layers"]}
    assert status["fc2"] == EXCLUDED and status["fc1"] == "partly_scored"
    assert ("fc1", "lira_offline:grad_norm") in {(e["layer"], e["attack"])
                                                  for e in record["attacks"]}
    assert record["peak_mia_accuracy"] is not None
