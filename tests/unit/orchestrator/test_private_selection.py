"""Private tuning's selection is read from verified records, never inferred from a file's absence
(issue 44): ``export``, ``pick``, ``report`` and ``audit`` refuse, in one line and exit 2, a run
whose selection record is missing, altered, or disagrees with the other records.

The run is the synthetic one (``bench.synthetic_run``) made a consistent private-tuning run:
config.toml says ``sweep.tuning = "private"``, ``private_tuning.json`` holds the secret counts,
every finished search trial has a noisy score, and summary.json holds the plan and the selected
trial (t14, the best noisy score among the dp_valid, release-safe ones). Each damage below is
what someone with write access could do: delete or edit a record, with or without rewriting its
manifest entry, and edit several records together. Each leaves some verified record at odds with
the others; a rewrite of all of them that agrees again (config, counts, noisy scores, summary)
cannot be told from the original without a copy kept elsewhere (docs/sweep.md, "The selection
on record"). No command trains: ``audit``'s training is replaced by a sentinel that proves the
selection check let it through.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dpsweep.core import layout
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.release.selection import SELECTED
from dpsweep.reports import store
from tests.unit.orchestrator.private_runs import (
    CHOSEN,
    OTHER,
    edit_json,
    private_run,
    rerecord,
    set_tuning,
)


class Trained(Exception):
    """Raised where ``dpsweep audit`` would start training: the selection check passed."""


@pytest.fixture(autouse=True)
def _audit_never_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpsweep.orchestrator.audit import canary

    def trained(*_a: object, **_k: object) -> None:
        raise Trained

    monkeypatch.setattr(canary, "load_trial_data", trained)


def _argv(command: str, run: Path, out: Path) -> list[str]:
    return {"export": ["export", str(run), "--trial", OTHER, "--out", str(out)],
            "pick": ["pick", str(run)], "report": ["report", str(run)],
            "audit": ["audit", str(run), "--trial", CHOSEN]}[command]


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (the lock's bookkeeping left out)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (layout.LOCK, layout.LOCK_INFO)}


def _refused(command: str, run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
             ) -> str:
    """The command's one line (exit 2); nothing written in the run directory or --out."""
    out = tmp_path / "release"
    before = _snapshot(run)
    capsys.readouterr()
    assert main(_argv(command, run, out)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert _snapshot(run) == before and not out.exists()
    return captured.err.strip()


def _delete(run: Path) -> None:
    (run / layout.SUMMARY).unlink()


def _alter(run: Path) -> None:
    edit_json(run / layout.SUMMARY, lambda s: s["tuning"].update({SELECTED: OTHER}))


def _alter_and_rehash(run: Path) -> None:
    _alter(run)
    rerecord(run, layout.SUMMARY)


def _drop_the_statement(run: Path) -> None:
    """summary.json's tuning entry removed and re-hashed: what remains reads as adaptive."""
    edit_json(run / layout.SUMMARY, lambda s: s.pop("tuning"))
    rerecord(run, layout.SUMMARY)


def _forget_the_choice(run: Path) -> None:
    edit_json(run / layout.SUMMARY, lambda s: s["tuning"].pop(SELECTED))
    rerecord(run, layout.SUMMARY)


def _promote_another_trial(run: Path) -> None:
    """The noisy scores rewritten (and re-hashed) so that another trial is the best."""
    frame = store.read_results(run)
    frame.loc[frame["trial_id"] == OTHER, "noisy_val_score"] = 0.97
    store.write_results(run, frame.to_dict("records"))
    rerecord(run, layout.RESULTS)


def _say_adaptive(run: Path) -> None:
    edit_json(run / layout.SUMMARY, lambda s: s["tuning"].update(mode="adaptive"))
    rerecord(run, layout.SUMMARY)


def _say_adaptive_everywhere(run: Path) -> None:
    """summary.json and config.toml both rewritten as an adaptive run's, and re-hashed."""
    _say_adaptive(run)
    set_tuning(run, "adaptive")
    rerecord(run, layout.CONFIG)


def _and_drop_the_counts(run: Path) -> None:
    """... and private_tuning.json removed with its manifest entry: the noisy scores remain."""
    _say_adaptive_everywhere(run)
    (run / layout.PRIVATE_TUNING).unlink()
    rerecord(run, layout.PRIVATE_TUNING)


def _delete_the_counts(run: Path) -> None:
    (run / layout.PRIVATE_TUNING).unlink()


DAMAGES = {
    "deleted": (_delete, "RUN_DIR = 'summary.json' is not allowed: expected an existing file "
                         "(listed in manifest.json, now missing"),
    "altered": (_alter, "RUN_DIR = 'summary.json' is not allowed: expected the file dpsweep "
                        "wrote (its SHA-256 differs from manifest.json"),
    "altered and re-hashed": (
        _alter_and_rehash, f"summary.json tuning.selected = '{OTHER}' is not allowed: expected "
                           f"'{CHOSEN}', the best noisy validation score in results.parquet"),
    "selection removed and re-hashed": (
        _forget_the_choice, "summary.json tuning.selected = 'missing' is not allowed: expected "
                            "the trial the sweep selected"),
    "scores rewritten and re-hashed": (
        _promote_another_trial, f"summary.json tuning.selected = '{CHOSEN}' is not allowed: "
                                f"expected '{OTHER}', the best noisy validation score"),
    "statement removed and re-hashed": (
        _drop_the_statement, "RUN_DIR = 'summary.json' is not allowed: expected the record of "
                             "private tuning's selection"),
    "mode rewritten": (_say_adaptive, "summary.json tuning.mode = 'adaptive' is not allowed: "
                                      "expected 'private', as config.toml's sweep.tuning says"),
    "config rewritten too": (
        _say_adaptive_everywhere, "config.toml sweep.tuning = 'adaptive' is not allowed: "
                                  "expected 'private': the run holds private_tuning.json"),
    "counts dropped too": (
        _and_drop_the_counts, "config.toml sweep.tuning = 'adaptive' is not allowed: expected "
                              "'private': the run holds noisy validation scores"),
    "counts deleted": (_delete_the_counts, "RUN_DIR = 'private_tuning.json' is not allowed: "
                                           "expected an existing file (listed in manifest.json"),
}
COMMANDS = ("export", "pick", "report", "audit")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return private_run(tmp_path_factory.mktemp("private"))


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "copy" / "run", symlinks=True))


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_altered_or_inconsistent_selection_record_is_refused_by_every_command(
        command: str, damage: str, pristine: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(pristine, tmp_path)
    harm, says = DAMAGES[damage]
    harm(run)
    line = _refused(command, run, tmp_path, capsys)
    assert line.startswith("dpsweep: error: ") and says in line, line


def test_the_intact_run_passes_the_check(pristine: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The checks refuse damage, not private runs: pick chooses the recorded trial, export
    refuses another trial by its id, the report builds and the audit reaches training."""
    run = _copy(pristine, tmp_path)
    assert main(["pick", str(run)]) == 0
    assert f"picked trial {CHOSEN}" in capsys.readouterr().out
    assert main(_argv("export", run, tmp_path / "out")) == 2
    assert capsys.readouterr().err.startswith(f"dpsweep: error: --trial = '{OTHER}'")
    assert main(["report", str(run)]) == 0
    with pytest.raises(Trained):
        main(_argv("audit", run, tmp_path))


@pytest.mark.parametrize("command", ["export", "pick"])
def test_an_unfinished_private_sweep_releases_nothing(command: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """No summary.json yet (the sweep stopped before its end): no end-to-end statement and no
    recorded selection exist, so nothing may leave; it was exported as an adaptive run."""
    run = private_run(tmp_path / "unfinished", summary=False)
    line = _refused(command, run, tmp_path, capsys)
    assert line.startswith("dpsweep: error: RUN_DIR = 'summary.json' is not allowed: expected "
                           "the record of private tuning's selection, written when the sweep "
                           "finishes"), line
    assert f"dpsweep resume {run}" in line


def test_an_unfinished_private_sweep_is_reported_and_audited(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Neither releases anything: they read the other records, checked as above."""
    run = private_run(tmp_path / "unfinished", summary=False)
    assert main(["report", str(run)]) == 0
    page = (run / layout.REPORT / "report.html").read_text()
    assert "Tuning is private, but summary.json records no end-to-end epsilon" in page
    assert "Adaptive hyperparameter search over private metrics" not in page  # config.toml's
    with pytest.raises(Trained):
        main(_argv("audit", run, tmp_path))
