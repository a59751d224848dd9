"""How a run's trials may be selected for release, read from records the manifest verifies and
refused when those records disagree (``dpsweep export``, ``pick``, ``report`` and ``audit``).

Under private tuning only the trial with the best noisy validation score may leave the run: the
end-to-end epsilon covers that selection and no other (``reports.pick.choose_private``). Whether
a run is private is therefore read from its ``config.toml`` (``sweep.tuning``), which the run
directory is created with and ``RunDir.open`` verifies, never from whether ``summary.json``
happens to be there: a private run whose summary was deleted was exported as an adaptive one,
any trial at all. The records that state the selection, each verified against the manifest and
checked against the others by :func:`read_selection`:

* ``config.toml``: ``sweep.tuning`` (a run that is no sweep, ``dpsweep train``'s, selects
  nothing);
* ``private_tuning.json``: the secret trial counts, written before a private sweep's first
  trial; an adaptive run has none, and no private run has more search trials than they count;
* ``results.parquet``: every finished search trial of a private sweep has its noisy score, an
  adaptive run's trials none;
* ``summary.json``, written when the sweep finishes: ``tuning.mode`` as the config says and,
  under private tuning, the plan (the end-to-end statement) and ``tuning.selected``, the trial
  the sweep selected, which must be the best noisy score of the verified results. A private
  sweep without it has not finished: nothing may be released from it yet.

A record that is missing, altered (its SHA-256 differs) or at odds with the others is refused in
one line (exit 2). What no check here can catch: the manifest lists hashes, it is no signature.
Whoever can write the run directory can rewrite every record and its manifest entry so that they
agree (config.toml, private_tuning.json, the noisy scores in results.parquet and summary.json
together); only a copy kept elsewhere (or a signed manifest, which dpsweep does not have) tells
that apart from the original.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.toml import tomllib
from dpsweep.core.vocabulary import OK
from dpsweep.orchestrator.config import SweepConfig
from dpsweep.orchestrator.release.statement import TUNING_MODES
from dpsweep.orchestrator.rundir import RESTORE, RunDir
from dpsweep.reports.pareto import NONPRIVATE
from dpsweep.reports.pick import NOISY, choose_private

#: summary.json's key, in a private sweep's tuning entry, of the trial the sweep selected.
SELECTED = "selected"
#: ``sweep.tuning`` of a private-tuning sweep.
PRIVATE = "private"
#: The manifest's ``kind`` of a sweep's run directory (``dpsweep train`` writes another).
SWEEP_KIND = "sweep"
#: What a refusal over records that disagree asks for.
DISAGREE = f"the records disagree: {RESTORE}"


@dataclass(frozen=True)
class Selection:
    """How a run's release is selected: privately or not, summary.json's verified tuning entry
    (None before the sweep finished, or for a run that is no sweep), and under private tuning
    the trial the sweep recorded as selected (None when no trial was admissible)."""

    private: bool
    tuning: dict[str, Any] | None
    selected: str | None = None

    def statement(self, *, target: float) -> dict[str, Any] | None:
        """The tuning statement a release of a trial at ``target`` carries (an adaptive sweep
        states one per target), without the selected trial's id, which bounds the secret number
        of trials from below and never leaves the run."""
        if self.tuning is None:
            return None
        entry = (self.tuning.get("by_target") or {}).get(f"{target:g}", self.tuning) or None
        return None if entry is None else {k: v for k, v in entry.items() if k != SELECTED}


def recorded_choice(frame: pd.DataFrame) -> str | None:
    """The trial a private sweep selects and records (``tuning.selected``): the best noisy
    score among its dp_valid, release-safe search trials; None when there is none."""
    try:
        return choose_private(frame).trial_id
    except UserInputError:
        return None


def read_selection(run: RunDir, *, frame: pd.DataFrame, release: bool) -> Selection:
    """The run's selection from its verified, mutually consistent records (module docstring);
    ``frame`` is its verified results store. ``release``: a command that lets a trial leave
    (``export``, ``pick``), which a private sweep that has not finished is refused."""
    mode = _recorded_mode(run)
    private = mode == PRIVATE
    _check_counts(run, frame=frame, mode=mode)
    _check_scores(frame, mode=mode)
    written = _written(run, layout.SUMMARY)
    tuning = _summary_tuning(run) if written else None
    if tuning is None:
        if private and (release or written):  # unfinished: nothing leaves; else a lost entry
            raise UserInputError(
                field="RUN_DIR", value=layout.SUMMARY,
                allowed=f"the record of private tuning's selection, written when the sweep "
                        f"finishes ({layout.CONFIG}: sweep.tuning = {PRIVATE!r}); no trial leaves "
                        f"an unfinished private sweep: `dpsweep resume {run.path}` finishes it")
        return Selection(private=private, tuning=None)
    if tuning.get("mode") != mode:
        raise UserInputError(field=f"{layout.SUMMARY} tuning.mode", value=tuning.get("mode"),
                             allowed=f"{mode!r}, as {layout.CONFIG}'s sweep.tuning says "
                                     f"({DISAGREE})")
    if not private:
        return Selection(private=False, tuning=tuning)
    return Selection(private=True, tuning=tuning,
                     selected=_check_selected(tuning, frame, run=run))


def read_run_config(run: RunDir) -> dict[str, Any]:
    """The run's config.toml, verified against the manifest and parsed (one line, exit 2, on
    anything that is not valid TOML)."""
    path = run.verify(layout.CONFIG)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserInputError(field="config", value=str(path),
                             allowed=f"valid TOML ({type(exc).__name__})") from None


def _recorded_mode(run: RunDir) -> str | None:
    """``sweep.tuning`` of the run's verified config.toml; None for a run that is no sweep."""
    if run.manifest.get("kind") != SWEEP_KIND:
        return None
    raw = read_run_config(run)
    sweep = raw.get("sweep") if isinstance(raw.get("sweep"), dict) else {}
    mode = sweep.get("tuning", SweepConfig().tuning)
    if mode not in TUNING_MODES:
        raise UserInputError(field=f"{layout.CONFIG} sweep.tuning", value=mode,
                             allowed=f"one of {TUNING_MODES}")
    return str(mode)


def _disagrees(mode: str | None, evidence: str) -> UserInputError:
    return UserInputError(field=f"{layout.CONFIG} sweep.tuning", value=mode,
                          allowed=f"{PRIVATE!r}: the run holds {evidence}, which only a "
                                  f"private-tuning sweep writes ({DISAGREE})")


def _written(run: RunDir, rel: str) -> bool:
    """Whether dpsweep wrote ``rel`` (listed with its hash) or something claims it did (the
    file is there); a listed first write that never happened counts as not written."""
    entry = run.manifest.get("files", {}).get(rel)
    exists = (run.path / rel).exists()
    return exists or (entry is not None and "sha256" in entry)


def _search_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The search's trials: no re-run, not the non-private baseline."""
    if frame.empty:
        return frame
    repeat = frame.get("repeat_of", pd.Series("", index=frame.index)).fillna("").astype(str)
    return frame[(frame["method"].astype(str) != NONPRIVATE) & (repeat == "")]


def _check_counts(run: RunDir, *, frame: pd.DataFrame, mode: str | None) -> None:
    """private_tuning.json: verified, and there exactly when the sweep is private and has
    started trials; it counts at least as many trials as the results hold."""
    if not _written(run, layout.PRIVATE_TUNING):
        if mode == PRIVATE and not _search_rows(frame).empty:
            raise UserInputError(
                field="RUN_DIR", value=layout.PRIVATE_TUNING,
                allowed=f"the secret trial counts a private-tuning sweep records before its "
                        f"first trial (listed in {layout.MANIFEST}; it is missing: {RESTORE})")
        return
    if mode != PRIVATE:
        raise _disagrees(mode, layout.PRIVATE_TUNING)
    path = run.verify(layout.PRIVATE_TUNING, hint=RESTORE)
    try:
        counts = json.loads(path.read_text(encoding="utf-8")).get("counts")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        counts = None
    if not (isinstance(counts, Mapping) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values())):
        raise UserInputError(field="RUN_DIR", value=layout.PRIVATE_TUNING,
                             allowed=f"the counts of trials per series as dpsweep writes them "
                                     f"({RESTORE})")
    if len(_search_rows(frame)) > sum(counts.values()):
        raise UserInputError(field="RUN_DIR", value=layout.RESULTS,
                             allowed=f"no more trials than private tuning drew "
                                     f"({layout.PRIVATE_TUNING}; {DISAGREE})")


def _check_scores(frame: pd.DataFrame, *, mode: str | None) -> None:
    """Noisy scores on every finished search trial of a private sweep, and on no other run's."""
    if frame.empty:
        return
    scored = (pd.to_numeric(frame[NOISY], errors="coerce").astype(float).map(math.isfinite)
              if NOISY in frame.columns else pd.Series(False, index=frame.index))
    if mode != PRIVATE:
        if scored.any():
            raise _disagrees(mode, f"noisy validation scores ({layout.RESULTS}, {NOISY})")
        return
    search = _search_rows(frame)
    unscored = search[(search["status"] == OK) & ~scored[search.index]]
    if not unscored.empty:
        raise UserInputError(field=f"{layout.RESULTS} {NOISY}",
                             value=f"none for {unscored['trial_id'].iloc[0]}",
                             allowed=f"a noisy score for every finished trial of a "
                                     f"private-tuning sweep ({DISAGREE})")


def _summary_tuning(run: RunDir) -> dict[str, Any] | None:
    """The tuning entry of the written summary.json, verified; None when it holds none (an
    older summary)."""
    path = run.verify(layout.SUMMARY, hint=RESTORE)
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserInputError(field="summary", value=str(path),
                             allowed=f"valid JSON ({type(exc).__name__})") from None
    if not isinstance(summary, dict):
        raise UserInputError(field="summary", value=str(path), allowed="a JSON object")
    tuning = summary.get("tuning")
    if tuning is None:
        return None
    if not isinstance(tuning, dict):
        raise UserInputError(field=f"{layout.SUMMARY} tuning", value=type(tuning).__name__,
                             allowed="the sweep's tuning statement (a JSON object)")
    return tuning


def _check_selected(tuning: Mapping[str, Any], frame: pd.DataFrame, *,
                    run: RunDir) -> str | None:
    """The recorded selection, which must be the best noisy score of the verified results."""
    expected = recorded_choice(frame)
    if SELECTED not in tuning:  # a summary of a dpsweep that did not record it yet
        raise UserInputError(
            field=f"{layout.SUMMARY} tuning.{SELECTED}", value="missing",
            allowed=f"the trial the sweep selected, which this dpsweep records (`dpsweep "
                    f"resume {run.path}` writes the summary again with it)")
    if tuning[SELECTED] != expected:
        raise UserInputError(
            field=f"{layout.SUMMARY} tuning.{SELECTED}", value=tuning[SELECTED],
            allowed=f"{expected!r}, the best noisy validation score in {layout.RESULTS} "
                    f"among the dp_valid, release-safe trials ({DISAGREE})")
    return expected
