"""``orchestrator.release.bundle`` and ``statement``: the release holds the model, its code, a
loader and its privacy statement, nothing else; ``dpsweep export`` refuses a degenerate trial
unless asked. (``test_export_loader.py`` tests load.py; ``tests/system/test_export_standalone.py``
loads exports in a fresh process.)"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import dpsweep.trainables.dp.randomness
from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.poisson import poisson_plan
from dpsweep.core.records import PrivacyRecord
from dpsweep.core.schedule import Schedule
from dpsweep.core.trial import Calibration, EpsilonBounds, TrialSpec
from dpsweep.core.vocabulary import ATTACK_OBJECTIVE, VALIDATION_OBJECTIVE
from dpsweep.orchestrator import __version__
from dpsweep.orchestrator.accounting.tuning.adaptive import adaptive_statement
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.release.bundle import RELEASE_ENTRIES, RELEASE_FILES, export_trial
from dpsweep.orchestrator.release.export import check_degenerate
from dpsweep.orchestrator.release.statement import (
    NOT_COVERED_PRIVATE_K,
    NOT_COVERED_SELECTION,
    privacy_statement,
    round_down,
    round_up,
)
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.trial.single import TRIAL_ID as SINGLE_TRIAL
from dpsweep.orchestrator.trial.single import train_single
from dpsweep.reports import store
from dpsweep.trainables.data.splits import DataSplits
from dpsweep.trainables.methods import get_method
from dpsweep.trainables.models.networks import build_model
from dpsweep.trainables.training.loop import (
    TrialResult,
    evaluate,
    load_trial_data,
    train_trial,
)
from tests.conftest import tiny_config

#: Distinctive values, so a search of the exported bytes cannot hit them by chance.
SPEC_SEED = 918_273_645
SECRET_SEED = 7_364_519_283_746_501_928  # its 8 bytes, repeated, are the "secret" key
TRIAL_ID = "dpsgd-0007"
EPSILON_UPPER = 3.987654321
DELTA = 1e-5
SIGMA = 1.1
EPOCHS = 2
FINAL = "epoch_002"


def _spec(*, data_dir: Path, randomness: str) -> TrialSpec:
    """A tiny digits trial with a calibration written by hand (the budget module is not under
    test here; the training loop checks the sampling rate and step count it is given)."""
    cfg = tiny_config()
    setup = check(cfg)
    sizes = dict(setup.split_sizes)
    q, steps_per_epoch = poisson_plan(dataset_size=sizes["train"],
                                      batch_size=cfg.training.batch_size)
    calibration = Calibration(
        target_epsilon=4.0, delta=DELTA, sample_rate=q,
        schedule=Schedule.constant(noise_multiplier=SIGMA, steps=EPOCHS * steps_per_epoch),
        scale=1.0,
        bounds=EpsilonBounds(lower=3.91, estimate=3.95, upper=EPSILON_UPPER, accountant="prv"),
        accountant="prv", fallback_reason=None, eps_error=0.008, seconds=0.0, cached=False)
    method = cfg.training.method
    return TrialSpec(
        method=method, method_params=get_method(method).validate_params(setup.trial_params(method)),
        epochs=EPOCHS, batch_size=cfg.training.batch_size, calibration=calibration,
        epsilon_curve=[2.8, EPSILON_UPPER], seed=SPEC_SEED, randomness=randomness,
        dataset="digits", data_dir=str(data_dir), sizes=sizes, device="cpu",
        trial_id=TRIAL_ID)


@dataclass
class Trained:
    root: Path
    spec: TrialSpec
    result: TrialResult
    data: DataSplits
    data_dir: Path
    secret_calls: int

    @property
    def checkpoint(self) -> Path:
        return self.root / FINAL

    def privacy(self) -> dict[str, Any]:
        """privacy.json as written."""
        return json.loads((self.root / "privacy.json").read_text())

    def record(self, **changes: Any) -> PrivacyRecord:
        """The trial's privacy record, with ``changes`` to its fields (validated)."""
        return PrivacyRecord.from_dict({**self.privacy(), **changes})


def _train(base: Path, *, randomness: str) -> Trained:
    data_dir = base / "private-data-dir-q7z"  # ignored for digits, recorded in the spec
    spec = _spec(data_dir=data_dir, randomness=randomness)
    data = load_trial_data(spec)
    calls: list[int] = []

    def known_key(nbytes: int) -> bytes:
        calls.append(1)
        return (SECRET_SEED.to_bytes(8, "little") * (nbytes // 8 + 1))[:nbytes]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dpsweep.trainables.dp.randomness, "secret_key", known_key)
        result = train_trial(spec, data=data, checkpoint_root=base / "trial")
    return Trained(root=base / "trial", spec=spec, result=result, data=data, data_dir=data_dir,
                   secret_calls=len(calls))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return _train(tmp_path_factory.mktemp("secret"), randomness="secret")


@pytest.fixture(scope="module")
def replayable(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return _train(tmp_path_factory.mktemp("reproducible"), randomness="reproducible")


@pytest.fixture(scope="module")
def release(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("releases") / "release"
    result = export_trial(checkpoint_dir=trained.checkpoint, privacy=trained.record(), out=out)
    assert result.out == out and result.files[:4] == RELEASE_FILES[:4]
    assert result.files[-2:] == RELEASE_FILES[-2:]
    assert all(f.startswith("code/") for f in result.files[4:-2])
    return out


def _fresh(release: Path) -> torch.nn.Module:
    info = json.loads((release / "model.json").read_text())
    return build_model(name=info["architecture"], input_shape=tuple(info["input_shape"]),
                       num_classes=info["num_classes"], activation=info["activation"])


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _files(release: Path) -> list[Path]:
    return sorted(p for p in release.rglob("*") if p.is_file())


#: What a built-in model's code/ holds (at least): dpsweep's modules that build it, as they are.
BUILTIN_CODE = {"dpsweep/core/errors.py", "dpsweep/trainables/models/catalog.py",
                "dpsweep/trainables/models/networks.py"}
REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------------------------
# The release


def test_release_holds_exactly_its_files(release: Path) -> None:
    assert sorted(p.name for p in release.iterdir()) == sorted(RELEASE_ENTRIES)
    assert all((release / name).is_file() for name in RELEASE_FILES)
    mode = release.stat().st_mode & 0o666  # umask-derived, as the directory's
    assert all(p.stat().st_mode & 0o777 == mode for p in _files(release))
    code = sorted(p.relative_to(release / "code").as_posix() for p in _files(release / "code"))
    assert BUILTIN_CODE | {"dpsweep/__init__.py", "dpsweep/core/__init__.py",
                         "dpsweep/trainables/__init__.py"} <= set(code)
    for name in code:  # copied as they are: the source the weights were trained with (in a
        # checkout, dpsweep's packages sit beside dpsweep/; the export nests them as installed)
        source = REPO / (name if name == "dpsweep/__init__.py" else name.removeprefix("dpsweep/"))
        assert (release / "code" / name).read_bytes() == source.read_bytes(), name
    assert (release / "load.py").read_bytes() == (
        REPO / "orchestrator" / "release" / "loader.py").read_bytes()
    assert _tree(release.parent) == sorted(
        ["release", *(f"release/{p.relative_to(release)}" for p in release.rglob("*"))])


def test_weights_reproduce_the_recorded_test_accuracy(trained: Trained, release: Path) -> None:
    recorded = json.loads((trained.root / "history.json").read_text())[-1]["test_accuracy"]
    assert recorded == trained.result.test_accuracy
    test = trained.data.test

    model = _fresh(release)
    model.load_state_dict(torch.load(release / "weights.pt", weights_only=True), strict=True)
    accuracy, _ = evaluate(model.eval(), test.x, test.y)
    assert accuracy == recorded

    tensors = load_file(release / "model.safetensors")
    assert tensors.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(tensors[name], value)
    from_safetensors = _fresh(release)
    from_safetensors.load_state_dict(tensors, strict=True)
    assert evaluate(from_safetensors.eval(), test.x, test.y)[0] == recorded


def test_weights_file_is_the_state_dict_only(release: Path) -> None:
    state = torch.load(release / "weights.pt", weights_only=True)
    assert isinstance(state, dict)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert set(state) == set(_fresh(release).state_dict())


def test_model_json_describes_the_architecture(release: Path) -> None:
    info = json.loads((release / "model.json").read_text())
    assert info["architecture"] == "digits_cnn"
    assert info["input_shape"] == [1, 8, 8]
    assert info["num_classes"] == 10
    assert info["activation"] == "tanh"
    assert info["layers"] == ["conv1", "conv2", "fc1", "fc2"]
    fresh = _fresh(release)
    assert info["parameters"] == sum(p.numel() for p in fresh.parameters())
    assert sum(info["layer_parameters"]) == info["parameters"]
    assert info["dpsweep_version"] == __version__
    assert info["input_normalization"] == {"max_value": 16.0, "mean": [0.3], "std": [0.37],
                                           "rule": info["input_normalization"]["rule"]}
    assert info["classes"] == [str(i) for i in range(10)]
    assert info["input_kind"] == "images"
    assert info["build"] == {"factory": "dpsweep.trainables.models.networks:build_model",
                             "args": {"name": "digits_cnn", "activation": "tanh"}}
    assert info["loader"] == "load.py" and "load.load(" in info["load"]
    assert info["code"]["dir"] == "code" and info["code"]["origin"] == "dpsweep"
    assert info["code"]["files"] == {
        p.relative_to(release / "code").as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in _files(release / "code")}
    assert "degenerate" not in info


def test_statement_matches_privacy_json(trained: Trained, release: Path) -> None:
    p = trained.privacy()
    s = json.loads((release / "privacy_statement.json").read_text())
    assert s["holds"] is True
    assert s["epsilon_exact"] == p["epsilon_upper"] == EPSILON_UPPER
    assert s["epsilon_display"] == "3.9877" and s["epsilon"] == 3.9877
    assert s["epsilon"] >= p["epsilon_upper"]
    assert s["epsilon_lower"] == p["epsilon_lower"]
    assert s["epsilon_estimate"] == p["epsilon_estimate"]
    assert s["target_epsilon"] == p["target_epsilon"]
    assert s["delta"] == p["delta"] == DELTA
    assert s["accountant"] == p["accountant"] == "prv"
    assert s["eps_error"] == p["eps_error"]
    assert s["accountant_fallback"] is None and p["accountant_fallback"] is None
    assert s["sample_rate"] == p["sample_rate"] == 0.1
    assert s["steps"] == p["steps"] == 20
    assert s["epochs"] == EPOCHS
    assert s["noise_schedule"] == p["noise_schedule"] == [{"noise_multiplier": SIGMA,
                                                           "steps": 20}]
    assert s["noise_multiplier"] == p["noise_multiplier"]
    assert s["clipping"] == {"clip_norm": p["clip_norm"]}
    for key in ("method", "mode", "dp_valid", "validity_reason", "randomness", "release_safe"):
        assert s[key] == p[key], key
    assert (s["method"], s["mode"], s["randomness"]) == ("dpsgd", "standard", "secret")
    assert s["versions"] == p["versions"]
    assert s["tuning"] is None and s["selection_covered"] is False
    assert s["audit"] is None and s["audit_contradicts"] is False
    assert NOT_COVERED_SELECTION in s["not_covered"]
    statements = {"privacy_statement.json", "privacy_statement.md"}
    assert s["artifacts"] == {
        p.relative_to(release).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in _files(release) if p.name not in statements}
    assert {"weights.pt", "model.safetensors", "model.json", "load.py",
            "code/dpsweep/trainables/models/networks.py"} <= set(s["artifacts"])

    md = (release / "privacy_statement.md").read_text()
    for text in ("epsilon: **3.9877**", "delta: **1e-05**", "q = 0.1", "20 steps",
                 f"sigma {SIGMA!r} for 20 steps", "clipping norm C = 1.0",
                 "eps_error: 0.0080", "release-safe: yes", p["validity_reason"],
                 "## Not covered by this epsilon", "No canary audit was given"):
        assert text in md, text


def test_release_contains_nothing_private(trained: Trained, release: Path) -> None:
    forbidden = [str(SPEC_SEED), "train_loss", "history", str(trained.data_dir),
                 str(SECRET_SEED), TRIAL_ID]
    assert trained.secret_calls > 0  # the known "secret" seed really seeded the noise
    run_files = {p.name: p.read_bytes() for p in trained.root.rglob("*") if p.is_file()}
    # The run directory does hold these (so the search below is meaningful) ...
    assert str(SPEC_SEED).encode() in run_files["spec.json"]
    assert str(trained.data_dir).encode() in run_files["spec.json"]
    assert b"train_loss" in run_files["history.json"]
    # ... except the secret seed, which is never written anywhere.
    assert not any(str(SECRET_SEED).encode() in data for data in run_files.values())
    for path in _files(release):
        data = path.read_bytes().lower()
        for text in forbidden:
            assert text.lower().encode() not in data, (path.name, text)
    assert str(REPO).encode() not in (release / "model.json").read_bytes()  # no paths


# --------------------------------------------------------------------------------------------
# Refusals write nothing


def _refused(tmp_path: Path, **kwargs: Any) -> UserInputError:
    before = _tree(tmp_path)
    with pytest.raises(UserInputError) as info:
        export_trial(**kwargs)
    assert _tree(tmp_path) == before
    return info.value


def test_reproducible_trial_is_refused_unless_allowed(replayable: Trained, tmp_path: Path
                                                      ) -> None:
    privacy = replayable.record()
    assert privacy.release_safe is False
    out = tmp_path / "release"
    error = _refused(tmp_path, checkpoint_dir=replayable.checkpoint, privacy=privacy, out=out)
    assert "--allow-replayable" in str(error) and error.field == "randomness"
    assert not out.exists()

    result = export_trial(checkpoint_dir=replayable.checkpoint, privacy=privacy, out=out,
                          allow_replayable=True)
    s = result.statement
    assert (s.holds, s.release_safe, s.randomness) == (False, False, "reproducible")
    assert s.headline.startswith("NO differential-privacy guarantee")
    assert "replayable" in s.headline
    assert sorted(p.name for p in out.iterdir()) == sorted(RELEASE_ENTRIES)
    for path in _files(out):
        assert str(SPEC_SEED).encode() not in path.read_bytes()


def test_invalid_dp_is_refused_unless_allowed(trained: Trained, tmp_path: Path) -> None:
    privacy = trained.record(dp_valid=False,
                             validity_reason="epsilon claim invalid: thresholds private")
    out = tmp_path / "release"
    error = _refused(tmp_path, checkpoint_dir=trained.checkpoint, privacy=privacy, out=out)
    assert "--allow-invalid-dp" in str(error) and error.field == "dp_valid"

    s = export_trial(checkpoint_dir=trained.checkpoint, privacy=privacy, out=out,
                     allow_invalid_dp=True).statement
    assert (s.holds, s.dp_valid) == (False, False)
    assert "thresholds private" in s.headline
    assert "DP-valid: **NO**" in (out / "privacy_statement.md").read_text()


def test_out_must_be_new_or_empty(trained: Trained, tmp_path: Path) -> None:
    kwargs = {"checkpoint_dir": trained.checkpoint, "privacy": trained.record()}
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert _refused(tmp_path, out=busy, **kwargs).field == "--out"
    assert (busy / "keep.txt").read_text() == "mine"

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert _refused(tmp_path, out=a_file, **kwargs).field == "--out"
    assert _refused(tmp_path, out=a_file / "below", **kwargs).field == "--out"

    empty = tmp_path / "empty"
    empty.mkdir()
    export_trial(out=empty, **kwargs)
    assert sorted(p.name for p in empty.iterdir()) == sorted(RELEASE_ENTRIES)
    nested = tmp_path / "new" / "deeper" / "release"
    export_trial(out=nested, **kwargs)
    assert sorted(p.name for p in nested.iterdir()) == sorted(RELEASE_ENTRIES)
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_record_of_another_trial_is_refused(trained: Trained, tmp_path: Path) -> None:
    error = _refused(tmp_path, checkpoint_dir=trained.checkpoint,
                     privacy=trained.record(epsilon_upper=1.5),
                     out=tmp_path / "release")
    assert error.field == "privacy.epsilon_upper"


def test_intermediate_checkpoint_is_refused(trained: Trained, tmp_path: Path) -> None:
    error = _refused(tmp_path, checkpoint_dir=trained.root / "epoch_001",
                     privacy=trained.record(), out=tmp_path / "release")
    assert error.field == "checkpoint" and "final checkpoint" in str(error)


def test_missing_checkpoint_is_refused(trained: Trained, tmp_path: Path) -> None:
    error = _refused(tmp_path, checkpoint_dir=tmp_path / "nowhere", privacy=trained.record(),
                     out=tmp_path / "release")
    assert error.field == "checkpoint"


# --------------------------------------------------------------------------------------------
# The statement on its own


def test_adaptive_tuning_is_stated_as_not_covering_selection(trained: Trained) -> None:
    adaptive = adaptive_statement(n_trials=12, per_trial_epsilon=EPSILON_UPPER, delta=DELTA,
                                  objectives=(VALIDATION_OBJECTIVE,))
    s = privacy_statement(privacy=trained.record(), spec=trained.spec.to_dict(),
                          tuning={"mode": "adaptive", **adaptive.to_dict()}, audit_bound=None)
    assert s.holds and not s.selection_covered
    assert s.tuning is not None and s.tuning["n_trials"] == 12
    assert s.tuning["statement"] == adaptive.statement
    assert s.tuning["composed_epsilon"] == adaptive.composed_epsilon
    assert NOT_COVERED_SELECTION in s.not_covered
    md = s.to_markdown()
    assert "adaptive sweep of 12 trials" in md and adaptive.statement in md


def test_a_sampler_that_saw_the_attack_gets_no_composed_bound_in_the_release(
        trained: Trained) -> None:
    """With the in-trial audit feeding TPE, the statement carries no composed epsilon that a
    reader could take for a guarantee on the selected model, and says why."""
    adaptive = adaptive_statement(n_trials=12, per_trial_epsilon=EPSILON_UPPER, delta=DELTA,
                                  objectives=(VALIDATION_OBJECTIVE, ATTACK_OBJECTIVE))
    s = privacy_statement(privacy=trained.record(), spec=trained.spec.to_dict(),
                          tuning={"mode": "adaptive", **adaptive.to_dict()}, audit_bound=None)
    assert not s.selection_covered and NOT_COVERED_SELECTION in s.not_covered
    assert s.tuning is not None and "composed_epsilon" not in s.tuning
    assert "composed_epsilon" not in json.dumps(s.to_dict())
    assert "membership-inference attack run inside every trial" in s.to_markdown()


def test_private_tuning_covers_selection_and_keeps_the_trial_count_secret(
        trained: Trained) -> None:
    plan = {"mode": "private", "end_to_end_epsilon": 5.123412, "delta": DELTA,
            "statement": "End-to-end guarantee: (5.123, 1e-05)-DP ...", "mean_trials": 10.0,
            "distribution": "poisson", "end_to_end_accountant": "rdp",
            "n_trials": 7}  # a careless caller's K: must not be copied
    s = privacy_statement(privacy=trained.record(), spec=trained.spec.to_dict(), tuning=plan,
                          audit_bound=None)
    assert s.selection_covered and s.holds
    assert s.tuning is not None and "n_trials" not in s.tuning
    assert s.tuning["end_to_end_epsilon_display"] == "5.1235"
    assert s.headline.startswith("(5.1235, 1e-05)-differential privacy end to end")
    assert NOT_COVERED_SELECTION not in s.not_covered
    assert NOT_COVERED_PRIVATE_K in s.not_covered
    assert '"n_trials"' not in json.dumps(s.to_dict())


def test_audit_bound_is_reported_and_checked_against_the_claim(trained: Trained) -> None:
    args = {"privacy": trained.record(), "spec": trained.spec.to_dict(), "tuning": None}
    ok = privacy_statement(**args, audit_bound={"eps_lower_bound": 0.51239, "canaries": 1000,
                                                "confidence": 0.95, "kind": "black-box"})
    assert ok.audit is not None and ok.holds and not ok.audit_contradicts
    assert (ok.audit["canaries"], ok.audit["confidence"]) == (1000, 0.95)
    assert ok.audit["eps_lower_bound_display"] == "0.5123"  # lower bounds round down
    assert "epsilon >= 0.5123 at confidence 0.95 from 1000 canaries" in ok.to_markdown()

    bad = privacy_statement(**args, audit_bound={"eps_lower_bound": 4.5, "canaries": 1000,
                                                 "confidence": 0.95})
    assert bad.audit_contradicts and not bad.holds
    assert "canary audit" in bad.headline
    assert "CONTRADICTS the claim" in bad.to_markdown()
    with pytest.raises(UserInputError) as info:
        privacy_statement(**args, audit_bound={"eps_lower_bound": 1.0, "confidence": 0.95})
    assert info.value.field == "audit_bound.canaries"


def test_clipping_keeps_only_clipping_records(trained: Trained) -> None:
    privacy = trained.record(method_record={
        "thresholds": [0.6, 0.8], "clip_norm_bounds": [0.1, 2.0], "cache_file": "abc123.json",
        "identity": {"seed": SPEC_SEED}})
    s = privacy_statement(privacy=privacy, spec=trained.spec.to_dict(), tuning=None,
                          audit_bound=None)
    assert s.clipping == {"clip_norm": 1.0, "thresholds": [0.6, 0.8],
                          "clip_norm_bounds": [0.1, 2.0]}
    assert "thresholds: [0.6, 0.8]" in s.to_markdown()


def test_rdp_fallback_is_stated(trained: Trained) -> None:
    spec = copy.deepcopy(trained.spec.to_dict())
    privacy = trained.record(accountant="rdp", accountant_fallback="PRV timed out after 60 s",
                             epsilon_lower=None, epsilon_estimate=None)
    s = privacy_statement(privacy=privacy, spec=spec, tuning=None, audit_bound=None)
    assert (s.accountant, s.epsilon_lower, s.epsilon_estimate) == ("rdp", None, None)
    md = s.to_markdown()
    assert "RDP fallback, because: PRV timed out after 60 s" in md
    assert "RDP accountant" in md
    assert "epsilon lower" not in md and "eps_error" not in md


def test_malformed_records_are_refused(trained: Trained) -> None:
    """By the record (each field on its own) or by the statement's own rules (a schedule that
    adds up to the steps, no negative lower bound or estimate)."""
    spec = trained.spec.to_dict()
    missing = trained.privacy()
    del missing["delta"]
    with pytest.raises(UserInputError) as info:
        PrivacyRecord.from_dict(missing)
    assert info.value.field == "privacy.delta"
    for key, value, field in (("sample_rate", 1.5, "sample_rate"),
                              ("epsilon_upper", float("nan"), "epsilon_upper"),
                              ("randomness", "dice", "randomness"),
                              ("steps", 19, "noise_schedule"),
                              ("epsilon_lower", -0.01, "epsilon_lower")):
        with pytest.raises(UserInputError) as info:
            privacy_statement(privacy=trained.record(**{key: value}), spec=spec, tuning=None,
                              audit_bound=None)
        assert info.value.field == f"privacy.{field}", key
    with pytest.raises(UserInputError) as info:
        privacy_statement(privacy=trained.record(), spec=spec,
                          tuning={"mode": "greedy", "statement": ""}, audit_bound=None)
    assert info.value.field == "tuning.mode"


def test_display_rounding_never_overstates_protection() -> None:
    assert round_up(EPSILON_UPPER) == "3.9877"
    assert round_up(2.0) == "2.0000"
    assert round_up(1.00001) == "1.0001"
    assert round_down(0.99999) == "0.9999"
    assert float(round_up(0.1 + 0.2)) >= 0.1 + 0.2


# --------------------------------------------------------------------------------------------
# A degenerate trial (at chance level) is exported only when asked for


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real single-trial run directory (``dpsweep train``'s code)."""
    train_single(check(tiny_config()), out=(out := tmp_path_factory.mktemp("single") / "run"))
    return out


def _degenerate_copy(run_dir: Path, tmp_path: Path) -> Path:
    """A copy whose results row says degenerate, re-recorded in the manifest."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    frame = store.read_results(copy)
    frame.loc[0, "degenerate"] = True
    store.write_results(copy, frame.to_dict("records"))
    with RunDir.open(copy, write=True) as opened:
        opened.record([layout.RESULTS])
    return copy


def test_export_of_a_degenerate_trial_is_refused_unless_allowed(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dpsweep.orchestrator.cli import main

    run = _degenerate_copy(run_dir, tmp_path)
    out = tmp_path / "release"
    before = _tree(tmp_path)
    capsys.readouterr()
    assert main(["export", str(run), "--trial", SINGLE_TRIAL, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"dpsweep: error: --trial = '{SINGLE_TRIAL}' is not allowed")
    assert "chance" in err and "--allow-degenerate exports it anyway" in err
    assert _tree(tmp_path) == before  # nothing written

    assert main(["export", str(run), "--trial", SINGLE_TRIAL, "--out", str(out),
                 "--allow-degenerate"]) == 0
    assert "WARNING: exported with --allow-degenerate" in capsys.readouterr().out
    degenerate = json.loads((out / "model.json").read_text())["degenerate"]
    assert "at chance level" in degenerate and "validation accuracy" in degenerate


def test_private_tuning_judges_degeneracy_by_the_noisy_score(run_dir: Path) -> None:
    """The noisy score is what the end-to-end epsilon covers; the noiseless flag is not read."""
    run = RunDir.open(run_dir, write=False)
    kw = {"allow_degenerate": False}
    high = {"degenerate": True, "noisy_val_score": 0.9}
    assert check_degenerate(run, high, SINGLE_TRIAL, private=True, **kw) is None
    low = {"degenerate": False, "noisy_val_score": 0.12}  # 10 classes: chance 0.1 + 0.1
    with pytest.raises(UserInputError) as info:
        check_degenerate(run, low, SINGLE_TRIAL, private=True, **kw)
    assert info.value.field == "--trial" and "noisy validation score" in str(info.value)
    reason = check_degenerate(run, low, SINGLE_TRIAL, private=True, allow_degenerate=True)
    assert reason is not None and "noisy validation score" in reason
    assert check_degenerate(run, low, SINGLE_TRIAL, private=False, **kw) is None
