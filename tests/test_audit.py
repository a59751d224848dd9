"""The membership-inference audit: it works (leaky vs private), its metrics are right, it fills
the results store, and bad inputs are user errors."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import UserInputError
from orchestrator import results
from orchestrator.config import Config, DataConfig, PrivacyConfig, TrainingConfig
from orchestrator.trial import plan_trial
from reports import audit
from reports.audit import (
    NonPrivateRecipe,
    TrialAudit,
    attack_metrics,
    audit_nonprivate,
    audit_run,
    audit_trial,
    balanced_indices,
    layer_features,
    thin_roc,
    tpr_at_fpr,
    unit_invariant,
    wilson_interval,
)
from tests.conftest import tiny_config
from trainables.data import DataSplits, SplitSizes, load_splits
from trainables.models import build_model
from trainables.training import TrialDiverged, train_trial

# The leaky model: a small private train set (members) that a non-private model overfits;
# the shadow pool gives each shadow 100 members and 900 non-members. The private model gets
# 300 members so that its interval is tight (+-0.04): the peak over four layers of a model
# that leaks nothing is biased upward, and with 100 + 100 examples it passes 0.55 by chance a
# few times in a hundred. Both use all 1,797 digits.
SIZES = SplitSizes(train=100, holdout=300, test=397, shadow=1000)
PRIVATE_SIZES = SplitSizes(train=300, holdout=300, test=197, shadow=1000)
SHADOWS = 3


def _table(label: str, result: TrialAudit) -> str:
    rows = [f"{label}: peak {result.attack.peak.name} "
            f"(shadow test acc {[round(s.test_accuracy, 3) for s in result.shadows]})"]
    for m in (*result.attack.layers, result.attack.loss):
        rows.append(f"  {m.name:6s} acc {m.accuracy:.3f} [{m.ci_low:.3f}, {m.ci_high:.3f}] "
                    f"auc {m.auc:.3f} tpr@1%fpr {m.tpr_at_1pct_fpr:.3f} (n {m.n_members}+"
                    f"{m.n_nonmembers})")
    return "\n".join(rows)


@pytest.fixture(scope="module")
def digits() -> DataSplits:
    return load_splits(dataset="digits", seed=0, sizes=SIZES)


@pytest.fixture(scope="module")
def leaky(digits: DataSplits) -> TrialAudit:
    """Non-private, 800 epochs of Adam on 100 examples: train accuracy 1.0, test ~0.88."""
    result = audit_nonprivate(digits, recipe=NonPrivateRecipe(), shadow_models=SHADOWS, seed=0)
    print("\n" + _table("non-private overfit", result))
    return result


@pytest.fixture(scope="module")
def private_digits() -> DataSplits:
    return load_splits(dataset="digits", seed=0, sizes=PRIVATE_SIZES)


@pytest.fixture(scope="module")
def private_dir(private_digits: DataSplits, tmp_path_factory: pytest.TempPathFactory) -> Path:
    sizes = PRIVATE_SIZES
    cfg = Config(data=DataConfig(train_size=sizes.train, holdout_size=sizes.holdout,
                                 test_size=sizes.test, shadow_size=sizes.shadow),
                 privacy=PrivacyConfig(epsilon=0.5),
                 training=TrainingConfig(epochs=20, batch_size=50, lr=0.5, clip_norm=1.0))
    spec = plan_trial(cfg, trial_id="eps0.5", data=private_digits)
    root = tmp_path_factory.mktemp("private") / "eps0.5"
    train_trial(spec, data=private_digits, checkpoint_root=root)
    return root


@pytest.fixture(scope="module")
def private(private_digits: DataSplits, private_dir: Path) -> TrialAudit:
    result = audit_trial(private_dir / "epoch_020", data=private_digits, shadow_models=SHADOWS,
                         seed=0,
                         write_to=private_dir)
    print("\n" + _table("DP-SGD epsilon 0.5", result))
    return result


# --- (a) the attack works -------------------------------------------------------------------


def test_overfit_model_leaks_and_private_model_does_not(leaky: TrialAudit,
                                                        private: TrialAudit) -> None:
    peak = leaky.attack.peak
    assert peak.ci_low > 0.55, peak
    other = private.attack.peak
    assert other.ci_low <= 0.5 <= other.ci_high or other.ci_high < peak.ci_low, other
    assert peak.accuracy > other.accuracy + 0.1
    # The loss-threshold baseline agrees.
    assert leaky.attack.loss.ci_low > 0.55
    assert private.attack.loss.ci_low <= 0.5 <= private.attack.loss.ci_high


def test_deeper_layers_leak_more_on_the_overfit_model(leaky: TrialAudit) -> None:
    first, *_, last = leaky.attack.layers
    assert (first.name, last.name) == ("conv1", "fc2")
    assert first.ci_low <= 0.5 <= first.ci_high  # the first conv layer: chance
    assert last.accuracy > first.accuracy + 0.1 and last.auc > first.auc + 0.1
    assert leaky.attack.peak.index >= 2  # a dense layer, not a conv layer


def test_trial_audit_records_shadows_budget_and_roc(private: TrialAudit,
                                                    private_dir: Path) -> None:
    spec = json.loads((private_dir / "spec.json").read_text())
    assert len(private.shadows) == SHADOWS and len({s.seed for s in private.shadows}) == SHADOWS
    for shadow in private.shadows:
        assert (shadow.n_members, shadow.n_nonmembers) == (300, 700)
        # Same member count as the target: same sampling rate, same matched sigma.
        assert shadow.noise_multiplier == pytest.approx(
            spec["calibration"]["schedule"][0]["noise_multiplier"])
        assert 0.99 * 0.5 <= shadow.epsilon_upper <= 0.5
    saved = json.loads((private_dir / audit.AUDIT_FILE).read_text())
    assert saved["peak_mia_accuracy"] == private.attack.peak.accuracy
    assert [layer["name"] for layer in saved["layers"]] == ["conv1", "conv2", "fc1", "fc2"]
    for entry in [*saved["layers"], saved["loss"]]:
        assert 2 <= len(entry["roc_fpr"]) == len(entry["roc_tpr"]) <= 200
        assert entry["roc_fpr"][0] == 0.0 and entry["roc_fpr"][-1] == 1.0
        assert entry["tpr_at_0.1pct_fpr_meaningful"] is False  # 300 non-members
    timings = (private.shadow_train_seconds, private.attack.fit_seconds,
               private.attack.eval_seconds)
    assert all(t > 0 for t in timings) and private.seconds >= sum(timings)
    assert private.target_train_seconds is not None and private.target_train_seconds > 0


# --- (b) metrics on synthetic scores ----------------------------------------------------------


def test_wilson_interval_matches_hand_computation() -> None:
    # 60 of 100, z = 1.96: centre (0.6 + 0.0192) / 1.0384, half-width
    # 1.96 / 1.0384 * sqrt(0.0024 + 0.000096) -> [0.50200, 0.69060].
    low, high = wilson_interval(successes=60, trials=100, z=1.96)
    assert (low, high) == pytest.approx((0.502002, 0.690599), abs=1e-5)
    assert audit.Z95 == pytest.approx(1.959964, abs=1e-6)
    assert wilson_interval(successes=0, trials=10)[0] == 0.0
    assert wilson_interval(successes=10, trials=10)[1] == 1.0
    with pytest.raises(ValueError):
        wilson_interval(successes=11, trials=10)


def test_tpr_at_fpr_on_a_hand_built_roc() -> None:
    fpr = np.array([0.0, 0.005, 0.01, 0.02, 1.0])
    tpr = np.array([0.0, 0.3, 0.5, 0.6, 1.0])
    assert tpr_at_fpr(fpr=fpr, tpr=tpr, max_fpr=0.01) == 0.5
    assert tpr_at_fpr(fpr=fpr, tpr=tpr, max_fpr=0.001) == 0.0
    assert tpr_at_fpr(fpr=fpr, tpr=tpr, max_fpr=1.0) == 1.0


def _synthetic(n_nonmembers: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-members score 0..(n-1)/n; of 100 members 30 beat every non-member, 20 beat all but
    the top one, 50 lose to all: TPR 0.3 at FPR 0, 0.5 from FPR 1/n on."""
    nonmembers = np.arange(n_nonmembers) / n_nonmembers
    between = (nonmembers[-2] + nonmembers[-1]) / 2
    members = np.concatenate([np.full(30, 2.0), np.full(20, between), np.full(50, -1.0)])
    scores = np.concatenate([members, nonmembers])
    labels = np.concatenate([np.ones(100, np.int64), np.zeros(n_nonmembers, np.int64)])
    return labels, scores


def test_attack_metrics_on_synthetic_scores() -> None:
    labels, scores = _synthetic(200)
    m = attack_metrics(name="x", index=0, labels=labels, scores=scores,
                       predicted=(scores > 1.5).astype(np.int64))
    assert m.tpr_at_1pct_fpr == pytest.approx(0.5)  # FPR 1/200 <= 1%
    assert m.tpr_at_01pct_fpr == pytest.approx(0.3)  # only FPR 0 is <= 0.1%
    assert m.auc == pytest.approx(0.3 + 0.2 * 199 / 200)
    assert m.tpr_at_1pct_fpr_meaningful and not m.tpr_at_01pct_fpr_meaningful
    assert m.accuracy == pytest.approx((0.3 + 1.0) / 2)  # balanced: TPR 0.3, TNR 1
    assert (m.n_members, m.n_nonmembers) == (100, 200)
    big = attack_metrics(name="x", index=0, labels=_synthetic(1000)[0],
                         scores=_synthetic(1000)[1], predicted=np.zeros(1100, np.int64))
    assert big.tpr_at_01pct_fpr_meaningful and big.tpr_at_01pct_fpr == pytest.approx(0.5)
    assert big.accuracy == 0.5 and big.summary()["tpr_at_0.1pct_fpr_meaningful"]


def test_balanced_accuracy_interval_uses_all_balanced_examples() -> None:
    labels = np.repeat([1, 0], 50)
    # 35 of 50 members and all 50 non-members right: 85 of 100.
    predicted = np.concatenate([np.ones(35), np.zeros(15), np.zeros(50)]).astype(np.int64)
    m = attack_metrics(name="x", index=0, labels=labels, scores=predicted.astype(float),
                       predicted=predicted)
    assert m.accuracy == pytest.approx(0.85)
    assert (m.ci_low, m.ci_high) == pytest.approx(wilson_interval(successes=85, trials=100))


def test_balancing_subsamples_the_larger_class_reproducibly() -> None:
    m, n = balanced_indices(n_members=100, n_nonmembers=30, rng=np.random.default_rng(1))
    assert len(m) == len(n) == 30
    assert len(set(m)) == 30 and set(m) <= set(range(100)) and sorted(n) == list(range(30))
    again, _ = balanced_indices(n_members=100, n_nonmembers=30, rng=np.random.default_rng(1))
    other, _ = balanced_indices(n_members=100, n_nonmembers=30, rng=np.random.default_rng(2))
    assert list(m) == list(again) and list(m) != list(other)


def test_thin_roc_keeps_endpoints_and_order() -> None:
    fpr = np.linspace(0, 1, 5000) ** 2
    tpr = np.sqrt(np.linspace(0, 1, 5000))
    f, t = thin_roc(fpr=fpr, tpr=tpr, max_points=200)
    assert 100 <= len(f) == len(t) <= 200
    assert (f[0], t[0], f[-1], t[-1]) == (0.0, 0.0, 1.0, 1.0)
    assert f == sorted(f) and t == sorted(t)
    assert sum(v < 1e-3 for v in f) >= 20  # the low-FPR end is kept dense for log plots
    short = thin_roc(fpr=fpr[:10], tpr=tpr[:10])
    assert len(short[0]) == 10


def _permute_units(model: torch.nn.Module, *, seed: int) -> torch.nn.Module:
    """The same function with the channels / hidden units of every hidden layer reordered."""
    permuted = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    conv1, conv2 = permuted.blocks["conv1"][0], permuted.blocks["conv2"][0]
    fc1, fc2 = permuted.blocks["fc1"][1], permuted.blocks["fc2"][0]
    with torch.no_grad():
        p1 = torch.randperm(conv1.out_channels, generator=gen)
        conv1.weight.copy_(conv1.weight[p1])
        conv1.bias.copy_(conv1.bias[p1])
        conv2.weight.copy_(conv2.weight[:, p1])
        p2 = torch.randperm(conv2.out_channels, generator=gen)
        conv2.weight.copy_(conv2.weight[p2])
        conv2.bias.copy_(conv2.bias[p2])
        per_channel = fc1.in_features // conv2.out_channels
        w = fc1.weight.reshape(fc1.out_features, conv2.out_channels, per_channel)
        fc1.weight.copy_(w[:, p2].reshape(fc1.out_features, -1))
        p3 = torch.randperm(fc1.out_features, generator=gen)
        fc1.weight.copy_(fc1.weight[p3])
        fc1.bias.copy_(fc1.bias[p3])
        fc2.weight.copy_(fc2.weight[:, p3])
    return permuted


@pytest.mark.parametrize(("name", "shape", "stats"),
                         [("digits_cnn", (1, 8, 8), False), ("cnn28", (1, 28, 28), True)])
def test_sorted_features_are_invariant_to_unit_order(name: str, shape: tuple[int, int, int],
                                                     stats: bool) -> None:
    """The reduction: conv maps of <= 1,024 values flattened (digits_cnn), larger ones to
    per-channel mean / std / max (cnn28's conv1: 16 x 13 x 13); then sorted per block, so a
    shadow and a target that differ by unit order give the same features."""
    torch.manual_seed(0)
    model = build_model(name=name, input_shape=shape, num_classes=10)
    x, y = torch.randn(16, *shape), torch.arange(16) % 10
    same = _permute_units(model, seed=1)
    assert torch.allclose(model(x), same(x), atol=1e-5)
    a = layer_features(model, x, y, classes=10, features="sorted")
    b = layer_features(same, x, y, classes=10, features="sorted")
    raw = layer_features(model, x, y, classes=10, features="raw")
    raw_same = layer_features(same, x, y, classes=10, features="raw")
    for layer in model.layer_names:
        np.testing.assert_allclose(a[layer], b[layer], atol=1e-5)
    assert not np.allclose(raw["fc1"], raw_same["fc1"])  # raw IRs depend on unit order
    conv1_width = 3 * 16 if stats else audit.QUANTILES  # 16 x 4 x 4 = 256 values thinned
    assert a["conv1"].shape == (16, conv1_width + 10)  # + one-hot label
    assert a["fc2"].shape == (16, 10 + 10 + 1)  # sorted logits, label, logit confidence
    blocks = unit_invariant(np.array([[3.0, 1.0, 2.0, 9.0, 7.0, 8.0]]), blocks=2)
    assert blocks.tolist() == [[1.0, 2.0, 3.0, 7.0, 8.0, 9.0]]
    thinned = unit_invariant(np.arange(9.0)[::-1][None], quantiles=3)
    assert thinned.tolist() == [[0.0, 4.0, 8.0]]  # minimum, median, maximum


def test_logit_confidence_is_logit_of_true_class_probability() -> None:
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    p = torch.softmax(torch.as_tensor(logits), dim=1).numpy()
    got = audit.logit_confidence(logits, torch.tensor([0, 2]))
    expected = [math.log(p[0, 0] / (1 - p[0, 0])), math.log(p[1, 2] / (1 - p[1, 2]))]
    assert got == pytest.approx(expected)


# --- (c) a results store ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("audit-run")
    for i, method in enumerate(["dpsgd", "dpsgd_lf"]):
        spec = plan_trial(tiny_config(method=method), trial_id=f"t{i}")
        train_trial(spec, checkpoint_root=run / results.TRIALS_DIR / f"t{i}")
    results.collect_trials(run)
    return run


def test_audit_run_fills_the_store_and_skips_audited_trials(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    frame = audit_run(run_dir, shadow_models=1, seed=0)
    assert frame["audit_error"].tolist() == ["", ""]
    assert frame["peak_mia_accuracy"].between(0, 1).all()
    assert frame["loss_attack_auc"].between(0, 1).all() and (frame["audit_seconds"] > 0).all()
    for _, row in frame.iterrows():
        layers = json.loads(row["mia_layers"])
        assert [entry["name"] for entry in layers] == ["conv1", "conv2", "fc1", "fc2"]
        assert {"name", "accuracy", "ci_low", "ci_high", "auc", "tpr_at_1pct_fpr",
                "tpr_at_0.1pct_fpr", "tpr_at_0.1pct_fpr_meaningful", "n_members",
                "n_nonmembers"} <= set(layers[0])
        assert row["peak_mia_accuracy"] == max(entry["accuracy"] for entry in layers)
        assert layers[row["peak_layer_index"]]["name"] == row["peak_layer"]
        saved = json.loads((run_dir / results.TRIALS_DIR / row["trial_id"]
                            / audit.AUDIT_FILE).read_text())
        # digits defaults: 600 train, 600 shadow -> 300 shadow members; q re-matched.
        (shadow,) = saved["shadows"]
        assert (shadow["n_members"], shadow["n_nonmembers"]) == (300, 300)
        assert shadow["noise_multiplier"] != row["noise_multiplier"]
        assert 0.99 * row["target_epsilon"] <= shadow["epsilon_upper"] <= row["target_epsilon"]

    def must_not_run(*args: object, **kwargs: object) -> TrialAudit:
        raise AssertionError("an audited trial was audited again")

    monkeypatch.setattr(audit, "audit_trial", must_not_run)
    again = audit_run(run_dir, shadow_models=1, seed=0)
    assert again["audit_error"].tolist() == ["", ""]
    assert again["audit_seconds"].tolist() == frame["audit_seconds"].tolist()


def test_a_failing_audit_is_recorded_and_the_others_go_on(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    frame = results.read_results(run)
    results.write_results(run, [{**r, "peak_mia_accuracy": math.nan}
                                for r in frame.to_dict("records")])
    real = audit.train_trial

    def diverge_on_t1(spec: object, **kwargs: object) -> object:
        if spec.trial_id.startswith("t1"):  # type: ignore[attr-defined]
            raise TrialDiverged("train loss became nan in epoch 1")
        return real(spec, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(audit, "train_trial", diverge_on_t1)
    out = audit_run(run, shadow_models=1, seed=1)
    assert out.loc[0, "audit_error"] == "" and not math.isnan(out.loc[0, "peak_mia_accuracy"])
    assert "TrialDiverged: train loss became nan" in out.loc[1, "audit_error"]
    assert math.isnan(out.loc[1, "peak_mia_accuracy"]) and out.loc[1, "mia_layers"] == "[]"


# --- (d) bad inputs ---------------------------------------------------------------------------


def test_missing_or_corrupt_checkpoints_are_user_errors(run_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    frame = results.read_results(run)
    results.write_results(run, [{**r, "peak_mia_accuracy": math.nan}
                                for r in frame.to_dict("records")])
    checkpoint = run / frame.loc[1, "checkpoint"]
    (checkpoint / "state.pt").write_bytes(b"not a torch file")
    with pytest.raises(UserInputError, match=r"state\.pt"):
        audit_run(run)
    with pytest.raises(UserInputError, match="readable dpsweep checkpoint"):
        audit_trial(checkpoint)
    for trial in (run / results.TRIALS_DIR).iterdir():
        shutil.rmtree(trial)
    with pytest.raises(UserInputError, match=re.escape(str(run / frame.loc[0, "checkpoint"]))):
        audit_run(run)
    with pytest.raises(UserInputError, match=r"containing state\.pt"):
        audit_trial(tmp_path)
    with pytest.raises(UserInputError, match="RUN_DIR"):
        audit_run(tmp_path / "nothing-here")


def test_bad_audit_settings_are_user_errors(digits: DataSplits, private_dir: Path) -> None:
    with pytest.raises(UserInputError, match="shadow_models"):
        audit_trial(private_dir / "epoch_020", data=digits, shadow_models=0)
    with pytest.raises(UserInputError, match="shadow_size"):
        audit.shadow_splits(digits, members=len(digits.shadow), index=0, seed=0)
