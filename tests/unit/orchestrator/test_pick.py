"""pick: validation accuracy only, constraints on the MIA upper bound, ties, refusals, verified
records and a pick_config.toml that loads."""

from __future__ import annotations

import json
import math
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from bench.synthetic_run import INVALID_REASON, SIZES, make_run
from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.toml import tomllib
from dpsweep.orchestrator.api import from_dict
from dpsweep.orchestrator.api import load_config as load
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.release.pick import pick_and_write
from dpsweep.orchestrator.trial.plan import config_from_spec
from dpsweep.orchestrator.trial.single import train_single
from dpsweep.reports import store
from dpsweep.reports.pick import choose
from tests.conftest import leaves, tiny_config
from tests.unit.orchestrator.private_runs import PLAN, private_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("pick"))


def _pick(run: Path, **kw: Any) -> str:
    args: dict[str, Any] = {"max_peak_mia": None, "min_val_acc": None, "series": None,
                            "allow_invalid_dp": False, "allow_replayable": False,
                            "export_to": None, **kw}
    return pick_and_write(run, **args)


def _doc(run: Path) -> dict[str, Any]:
    return tomllib.loads((run / layout.PICK).read_text())


def test_default_pick_is_the_most_accurate_admissible_front_trial(run_dir: Path) -> None:
    text = _pick(run_dir)
    doc = _doc(run_dir)
    sel = doc["selection"]
    # t7 (.93, invalid DP) and t13 (.92, replayable) are more accurate but not admissible
    assert sel["trial_id"] == "t4" and sel["series"] == "ww_dpsgd" and sel["dp_valid"] is True
    assert sel["release_safe"] is True and sel["target_epsilon"] == 3.0
    assert sel["val_accuracy"] == pytest.approx(0.91)
    assert sel["val_accuracy_ci"] == pytest.approx([0.896659, 0.921769], abs=1e-6)
    assert sel["test_accuracy"] == pytest.approx(0.90)
    assert sel["test_accuracy_note"] == "reported, not used to choose"
    assert sel["peak_mia_upper"] == pytest.approx(0.615) and sel["peak_attack"] == "lira"
    # tied within the validation intervals: t1 (.90) and t9 / t10 (.89); not t5 (.88)
    assert [t["trial_id"] for t in sel["ties"]] == ["t1", "t9", "t10"]
    assert sel["front_trials"] == ["t23", "t6", "t2", "t9", "t10", "t5", "t1", "t4"]
    assert sel["constraints"] == {"allow_invalid_dp": False, "allow_replayable": False}
    config = from_dict(doc["config"])
    assert load(run_dir / layout.PICK_CONFIG) == config
    assert config.training.method == "ww_dpsgd" and config.training.seed == 3
    assert config.training.reproducible is False and config.training.preset == ""
    assert config.method_params["lr"] == pytest.approx(0.8)
    assert config.method_params["mode"] == "standard"
    assert config.data.dataset == "fashion-mnist"
    assert config.data.validation_size == SIZES["validation"]
    assert config.privacy.epsilon == 3.0 and config.sweep.methods == ["ww_dpsgd"]
    assert Path(doc["checkpoint"]["path"]) == run_dir / "trials/t4/checkpoint"
    privacy = doc["privacy"]
    assert privacy["epsilon_upper"] == pytest.approx(2.991) and privacy["accountant"] == "prv"
    assert privacy["noise_schedule"] == [{"noise_multiplier": 1.21, "steps": 100}]
    assert "accountant_fallback" not in privacy  # null in the record: TOML has no null
    assert "picked trial t4 (series ww_dpsgd, target epsilon 3)" in text
    assert "test accuracy        0.9000  (reported, not used to choose)" in text
    assert "3 trial(s) tied within their validation intervals" in text
    assert "WARNING" not in text


def test_constraints_apply_to_the_upper_bound_and_ties_are_reported(run_dir: Path) -> None:
    frame = store.read_results(run_dir)
    # uppers: t23 .54, t6 .55, t2 .56, t9/t10 .57, t5 .575, t1 .59, t4 .615
    choice = choose(frame, validation_size=2000, max_peak_mia=0.571)
    assert choice.trial_id == "t9"  # t10 is identical: the readable trial id decides
    assert choice.qualifying == ("t9", "t10", "t6", "t2", "t23")
    assert [t["trial_id"] for t in choice.ties] == ["t10", "t6"]
    # peak_mia_accuracy .56 would pass 0.571, its upper bound .59 does not
    assert "t1" not in choice.qualifying
    choice = choose(frame, validation_size=2000, min_val_acc=0.9, max_peak_mia=0.6)
    assert choice.trial_id == "t1" and choice.ties == ()
    assert choose(frame, validation_size=2000, series="dpsgd").trial_id == "t1"
    assert choose(frame, validation_size=2000, allow_replayable=True).trial_id == "t13"


def test_invalid_and_replayable_trials_only_when_allowed(run_dir: Path) -> None:
    text = _pick(run_dir, allow_invalid_dp=True)
    sel = _doc(run_dir)["selection"]
    assert sel["trial_id"] == "t7" and sel["dp_valid"] is False
    assert sel["validity_reason"] == INVALID_REASON and sel["audit_contradicts"] is True
    doc = _doc(run_dir)
    assert doc["config"]["method_params"]["mode"] == "faithful"
    assert doc["config"]["sweep"]["methods"] == ["dp_adamilg:faithful"]
    assert "WARNING: epsilon claim invalid" in text
    assert "WARNING: claim contradicted by audit" in text
    text = _pick(run_dir, allow_replayable=True)
    doc = _doc(run_dir)
    assert doc["selection"]["trial_id"] == "t13" and doc["selection"]["release_safe"] is False
    assert doc["config"]["training"]["reproducible"] is True
    assert "WARNING: replayable: not releasable" in text


def test_refusals_name_the_constraint_and_the_closest_trials(run_dir: Path) -> None:
    frame = store.read_results(run_dir)
    with pytest.raises(UserInputError) as info:
        choose(frame, validation_size=2000, max_peak_mia=0.5)
    assert info.value.field == "--max-peak-mia" and info.value.value == 0.5
    message = str(info.value)
    assert "of the 8 admissible front trials (all series), 8 have a peak MIA upper bound " \
           "above 0.5" in message
    assert "3 other audited trials were excluded" in message
    assert "none of them would qualify either" in message
    closest = message.split("closest: ")[1].split("; ")
    assert [c.split(" ")[0] for c in closest] == ["t23", "t6", "t2"]
    with pytest.raises(UserInputError) as info:
        choose(frame, validation_size=2000, max_peak_mia=0.6, min_val_acc=0.92)
    assert info.value.field == "--max-peak-mia/--min-val-acc"
    assert "8 have validation accuracy below 0.92" in str(info.value)
    assert "admits them; 2 of them would qualify" in str(info.value)  # t7, t13
    with pytest.raises(UserInputError, match=r"admissible front trials \(series dp_adamilg\)"):
        choose(frame, validation_size=2000, series="dp_adamilg", min_val_acc=0.9)
    with pytest.raises(UserInputError) as info:
        choose(frame, validation_size=2000, series="dp_adamilg:faithful")
    assert info.value.field == "--allow-invalid-dp"
    with pytest.raises(UserInputError, match="--series"):
        choose(frame, validation_size=2000, series="nope")
    with pytest.raises(UserInputError, match="--max-peak-mia"):
        choose(frame, validation_size=2000, max_peak_mia=1.5)
    with pytest.raises(UserInputError, match="--min-val-acc"):
        choose(frame, validation_size=2000, min_val_acc=float("nan"))
    with pytest.raises(UserInputError, match="run the audit first") as info:
        choose(frame.assign(peak_mia_accuracy=float("nan")), validation_size=2000,
               run_dir="runs/a")
    assert info.value.field == "RUN_DIR" and info.value.value == "runs/a"  # not the scope
    assert "non-degenerate DP trial in all series" in info.value.allowed


def test_cli_refusal_is_one_line_and_exit_2(run_dir: Path, capsys: pytest.CaptureFixture
                                            ) -> None:
    (run_dir / layout.PICK).unlink(missing_ok=True)
    assert main(["pick", str(run_dir), "--max-peak-mia", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dpsweep: error: --max-peak-mia = 0.5")
    assert not (run_dir / layout.PICK).exists()
    assert main(["pick", str(run_dir), "--min-val-acc", "0.9", "--max-peak-mia", "0.6"]) == 0
    assert "picked trial t1" in capsys.readouterr().out


def test_test_accuracy_is_never_read_to_choose(tmp_path: Path, run_dir: Path) -> None:
    def poison(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            row["test_accuracy"] = 1.0 - float(row["val_accuracy"] or 0.0)

    poisoned = make_run(tmp_path, rows_hook=poison)
    for kw in ({}, {"max_peak_mia": 0.571}, {"allow_invalid_dp": True}):
        _pick(run_dir, **kw)
        _pick(poisoned, **kw)
        clean, dirty = _doc(run_dir)["selection"], _doc(poisoned)["selection"]
        assert dirty["test_accuracy"] == pytest.approx(1.0 - dirty["val_accuracy"])
        for key in ("trial_id", "ties", "qualifying_front_trials", "front_trials"):
            assert dirty[key] == clean[key], key


def test_records_are_verified_by_the_manifest_and_nothing_is_written(tmp_path: Path) -> None:
    run = make_run(tmp_path / "a")
    (run / "trials/t4/spec.json").unlink()
    with pytest.raises(UserInputError, match=r"trials/t4/spec\.json.*now missing"):
        _pick(run)
    run = make_run(tmp_path / "b")
    shutil.rmtree(run / "trials/t4/checkpoint")
    with pytest.raises(UserInputError, match="checkpoint directory of the picked trial 't4'"):
        _pick(run)
    run = make_run(tmp_path / "c")
    (run / "trials/t4/checkpoint/state.pt").write_bytes(b"tampered")
    with pytest.raises(UserInputError, match="modified or replaced"):
        _pick(run)
    run = make_run(tmp_path / "d")
    frame = store.read_results(run)
    frame.loc[frame["trial_id"] == "t1", "val_accuracy"] = 0.99
    store.write_results(run, frame.to_dict("records"))  # edited behind the manifest's back
    with pytest.raises(UserInputError, match=r"results\.parquet.*modified or replaced"):
        _pick(run)
    (run / "manifest.json").unlink()
    with pytest.raises(UserInputError, match="RUN_DIR"):
        _pick(run)
    for name in "abcd":
        assert not (tmp_path / name / "run" / layout.PICK).exists()
        assert not (tmp_path / name / "run" / layout.PICK_CONFIG).exists()


def test_export_is_delegated_to_release(run_dir: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Path, dict[str, Any]]] = []

    class Result:
        def summary(self) -> str:
            return "release written to OUT"

    def export_from_run(run: Path, **kw: Any) -> Result:
        calls.append((run, kw))
        return Result()

    fake = types.ModuleType("dpsweep.orchestrator.release.export")
    fake.export_from_run = export_from_run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dpsweep.orchestrator.release.export", fake)
    text = _pick(run_dir, allow_replayable=True, export_to=tmp_path / "out")
    assert calls == [(run_dir, {"trial_id": "t13", "out": tmp_path / "out",
                                "allow_replayable": True, "allow_invalid_dp": False,
                                "allow_degenerate": False, "out_field": "--export"})]
    assert "exported             release written to OUT" in text
    _pick(run_dir, export_to=tmp_path / "again", allow_degenerate=True)
    assert calls[-1][1]["allow_degenerate"] is True  # --allow-degenerate reaches the export


@pytest.mark.parametrize("index", [0, 3, 5, 6, 8, 11])
def test_config_reproduces_the_trial_spec(index: int) -> None:
    """Everything a spec takes from the config comes back from config_from_spec: method and
    its validated hyperparameters, sizes, batch, epochs, seed, randomness, budget."""
    from bench.synthetic_run import TRIALS, make_spec
    from dpsweep.orchestrator.trial.plan import randomness_kind

    spec = make_spec(TRIALS[index], seed=index)
    cfg = config_from_spec(json.loads(json.dumps(spec)))
    setup = check(cfg)
    assert setup.trial_params(spec["method"]) == spec["method_params"]
    assert setup.split_sizes == spec["sizes"]
    assert (cfg.training.method, cfg.training.batch_size, cfg.training.epochs,
            cfg.training.seed, cfg.training.max_physical_batch) == \
        (spec["method"], spec["batch_size"], spec["epochs"], spec["seed"],
         spec["max_physical_batch"])
    assert randomness_kind(cfg) == spec["randomness"]
    assert (cfg.privacy.epsilon, cfg.privacy.delta) == \
        (spec["calibration"]["target_epsilon"], spec["calibration"]["delta"])
    assert (cfg.data.dataset, cfg.data.split_seed, cfg.model.name, cfg.model.activation) == \
        (spec["dataset"], spec["split_seed"], spec["model"], spec["activation"])
    assert setup.series() == [(spec["method"], spec["method_params"]["mode"])]


def test_prepared_parameters_are_not_written_as_hyperparameters() -> None:
    from bench.synthetic_run import TRIALS, make_spec
    from dpsweep.trainables.methods import get_method

    spec = make_spec(TRIALS[0], 0)
    spec["method"] = "lm_dpsgd"
    spec["method_params"] = {**get_method("lm_dpsgd").validate_params({"r": 2.0}),
                             "risk": [0.4, 0.3, 0.2, 0.1], "risk_meta": {"cache_file": "c.json"}}
    params = config_from_spec(spec).method_params
    assert params["r"] == 2.0 and "risk" not in params and "risk_meta" not in params


# ---- private tuning ----------------------------------------------------------------------------
#: Keys that would carry a noiseless metric (or the list of trials, whose length is K).
NOISELESS_KEYS = {"val_accuracy", "val_accuracy_ci", "test_accuracy", "val_loss", "test_loss",
                  "peak_mia_accuracy", "peak_mia_upper", "leak_detected", "ties",
                  "qualifying_front_trials", "front_trials", "train_loss_nonprivate"}


def test_private_choice_reads_the_noisy_score_only() -> None:
    import pandas as pd

    from dpsweep.reports.pick import choose_private

    def row(tid: str, noisy: float, **kw: Any) -> dict[str, Any]:
        return {"trial_id": tid, "status": "ok", "method": "dpsgd", "series": "dpsgd",
                "repeat_of": "", "dp_valid": True, "release_safe": True,
                "noisy_val_score": noisy, "val_accuracy": 1.0 - noisy, "degenerate": False,
                **kw}

    frame = pd.DataFrame([
        row("t1", 0.6), row("t2", 0.7, degenerate=True), row("t3", 0.9, dp_valid=False),
        row("t4", 0.8, release_safe=False), row("t5", 0.95, repeat_of="t1"),
        row("t6", math.nan), row("t7", 0.99, status="failed"),
        row("nonprivate", 0.999, method="nonprivate", noisy_val_score=math.nan)])
    assert choose_private(frame).trial_id == "t2"
    assert choose_private(frame, allow_invalid_dp=True).trial_id == "t3"
    assert choose_private(frame, allow_replayable=True).trial_id == "t4"
    with pytest.raises(UserInputError, match="K = 0") as info:
        choose_private(frame[frame["trial_id"].isin(["t6", "t7", "nonprivate"])],
                       run_dir="runs/p")
    assert info.value.field == "RUN_DIR" and info.value.value == "runs/p"
    with pytest.raises(UserInputError) as info:
        choose_private(frame[frame["trial_id"].isin(["t3", "t4"])])
    assert info.value.field == "--allow-invalid-dp/--allow-replayable"


def test_private_pick_writes_the_noisy_score_and_the_statement_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = private_run(tmp_path)
    chosen = store.read_results(run).set_index("trial_id").loc["t14"]
    assert main(["pick", str(run)]) == 0
    out = capsys.readouterr().out
    assert "picked trial t14" in out and "0.9500" in out and "2.9812" in out
    assert "validation accuracy " not in out and "test accuracy" not in out
    doc = _doc(run)
    sel = doc["selection"]
    assert sel["trial_id"] == "t14" and sel["noisy_val_score"] == 0.95
    assert sel["dp_valid"] is True and sel["release_safe"] is True
    assert doc["tuning"]["end_to_end_epsilon"] == PLAN["end_to_end_epsilon"]
    assert doc["tuning"]["statement"] == PLAN["statement"]
    noiseless = {float(chosen[k]) for k in ("val_accuracy", "test_accuracy", "val_loss",
                                            "peak_mia_accuracy", "peak_mia_upper")}
    history = json.loads((run / "trials/t14/history.json").read_text())
    noiseless |= {float(v) for epoch in history for k, v in epoch.items()
                  if "accuracy" in k or "loss" in k}
    values = leaves(doc)
    assert values and not [p for p, _ in values if p.rsplit(".", 1)[-1] in NOISELESS_KEYS]
    assert not [(p, v) for p, v in values if isinstance(v, float) and v in noiseless]
    assert "expected_trials" not in doc["tuning"] and "n_trials" not in doc["tuning"]
    assert load(run / layout.PICK_CONFIG).training.method == "dpsgd"
    # the only selection covered: no constraint, admitted flags move the choice by the score
    assert main(["pick", str(run), "--max-peak-mia", "0.6"]) == 2
    assert "private-tuning run" in capsys.readouterr().err
    _pick(run, allow_invalid_dp=True)
    assert _doc(run)["selection"]["trial_id"] == "t7"


def test_a_refusal_shows_the_run_directory_the_user_typed(tmp_path: Path) -> None:
    """A single unaudited trial: nothing to pick; the line's RUN_DIR is the path given."""
    run = tmp_path / "run"
    train_single(check(tiny_config()), out=run)
    with pytest.raises(UserInputError, match="audited") as info:
        pick_and_write(run, max_peak_mia=None, min_val_acc=None, series=None,
                       allow_invalid_dp=False, allow_replayable=False, export_to=None)
    assert info.value.field == "RUN_DIR" and info.value.value == str(run)
