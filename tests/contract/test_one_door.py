"""One door: every config rule of the bad-input table refuses the same config with the same
message through the command line and through the Python API, before Ray starts and before
anything is written; and nothing but the door makes the setup that sweeps and trains."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator import api, door
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.config import parse_file
from dpsweep.orchestrator.sweep.driver import run_sweep
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.orchestrator.trial.setup import ResolvedSetup
from dpsweep.orchestrator.trial.single import train_single
from dpsweep.trainables.methods import METHODS
from tests.conftest import tiny_config
from tests.contract.test_bad_input import (
    CASES,
    PREFIX,
    Case,
    Ctx,
    Runs,
    _Reached,
    _user,
    guarded,  # noqa: F401  (a fixture)
    runs,  # noqa: F401  (a fixture)
    snapshot,
)

#: The verbs whose CONFIG goes through the door, and the API call that takes the same config.
CONFIG_VERBS = ("config", "run", "train")
#: Refusals of ``train`` that are the command's own, not the config's: it trains one target.
TRAIN_ONLY = ("budget.epsilons",)


def _unflagged(line: str) -> str:
    """A flag of the command line is the API's keyword of the same name (--out: out)."""
    return line.replace(f"{PREFIX}--", PREFIX, 1)


def _config_cases() -> list[Case]:
    return [c for c in CASES if c.id.split("-")[0] not in ("resume", "reaudit", "export",
                                                             "pick", "audit", "report")]


def _api_refusal(argv: list[str]) -> UserInputError | None:
    """What the API says of the config ``argv`` names: ``config --check`` and ``train`` are
    ``api.load_config``; ``run`` is ``api.run`` on the config parsed field by field (so that
    its cross-field and model rules are the door's, not the loader's)."""
    verb = argv[0]
    path = argv[2] if verb == "config" else argv[1]
    address = argv[argv.index("--address") + 1] if "--address" in argv else None
    try:
        if verb == "run":
            api.run(parse_file(path), out=argv[argv.index("--out") + 1], address=address)
        else:
            api.load_config(path)
    except UserInputError as exc:
        return exc
    return None


@pytest.mark.parametrize("case", _config_cases(), ids=lambda c: c.id)
def test_the_cli_and_the_api_refuse_a_config_with_the_same_line(
        case: Case, runs: Runs, tmp_path: Path,  # noqa: F811
        guarded: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    ctx = Ctx(tmp=tmp_path, runs=runs, monkeypatch=guarded)
    argv = case.argv(ctx)
    if argv[0] not in CONFIG_VERBS or argv[:2] == ["config", "--method"]:
        pytest.skip(f"{' '.join(argv[:2])} takes no CONFIG")
    before = snapshot(tmp_path)
    capsys.readouterr()
    try:
        rc: object = main(argv)
    except SystemExit as exc:  # argparse: a flag, not a config
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(PREFIX), err
    try:
        refusal = _api_refusal(argv)
    except _Reached:
        pytest.fail(f"the API let through what the command line refuses: {err}")
    if refusal is None:  # the API has no `train`: its --out and its one target are its own
        assert argv[0] == "train" and any(f in TRAIN_ONLY or f.startswith("--")
                                          for f in case.fields), err
        return
    assert _unflagged(f"{PREFIX}{refusal}") == _unflagged(err)
    assert snapshot(tmp_path) == before, "a refused config must write nothing"


def test_the_door_alone_makes_a_checked_setup(tmp_path: Path) -> None:
    cfg = tiny_config()
    with pytest.raises(TypeError, match=r"orchestrator\.door\.check"):
        door.CheckedSetup(config=cfg)
    unchecked = ResolvedSetup(config=cfg)
    for call in (lambda: run_sweep(unchecked, run_dir=tmp_path / "sweep"),  # type: ignore[arg-type]
                 lambda: train_single(unchecked, out=tmp_path / "trial"),  # type: ignore[arg-type]
                 lambda: plan_trial(unchecked)):  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="CheckedSetup"):
            call()
    assert not any(tmp_path.iterdir())
    assert isinstance(door.check(cfg), door.CheckedSetup)


def test_a_config_changed_after_the_door_is_checked_again(tmp_path: Path) -> None:
    """``api.run`` never trusts a Config: one that passed ``load_config`` and was then changed
    meets the rules again (delta at 1/n is refused by the door, not by a trial in Ray)."""
    cfg = tiny_config()
    bad = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, delta=0.5))
    with pytest.raises(UserInputError) as exc:
        api.run(bad, out=tmp_path / "out")
    assert exc.value.field == "privacy.delta"
    assert not (tmp_path / "out").exists()


def test_a_sweep_that_names_no_method_leaves_out_those_the_model_cannot_train(
        runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    """A frozen backbone's head is one trained layer: the default "every method" sweep runs
    each method that can train it and says which it leaves out, rather than queue trials of
    layer freezing that can only fail."""
    ctx = Ctx(tmp=tmp_path, runs=runs, monkeypatch=pytest.MonkeyPatch())
    argv = _user("frozen_body")(ctx)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dpsgd_lf left out (needs at least 2 trained layers, the model has 1)" in out
    setup = door.check_file(argv[-1])
    assert [m for m, _ in setup.series()] == [m for m in METHODS if m != "dpsgd_lf"]
    assert list(setup.left_out) == ["dpsgd_lf"]
