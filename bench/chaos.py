"""A chaos soak on the real CLI: many short trials, kill -9 at random moments, resume to the end.

Two soaks, each a digits sweep (tiny model, a few epochs, batch 50, audit off: a trial takes a
second or two with Ray's overhead) driven by ``dpsweep run``, then ``dpsweep resume RUN_DIR``
after every fault that stopped it, until the sweep ran to its end: ``asha`` (ASHA_TRIALS DP-SGD
trials, ``sweep.pruner = "asha"``) and ``private`` (``sweep.tuning = "private"``, no pruner, a
secret Poisson number of trials with mean PRIVATE_EXPECTED_TRIALS).

The faults follow a seeded schedule (:func:`fault_schedule`) of kind, anchor and delay. Kinds:
``driver`` (SIGKILL to the dpsweep process alone, ``kill -9 PID``), ``group`` (to its whole
process group, ``kill -9 -PGID``; Ray's workers sit in groups of their own and must go by Ray's
fate sharing), ``worker`` (to one of this command's Ray workers training a trial,
``ray::ImplicitFunc``: the sweep goes on and must run that trial again under its id). Anchors:
``start`` (the delay counts from when the wait began: from the imports through Ray's start to
the first trials) or ``record`` (from the next trial record written). At the end
(:func:`check_run`, :class:`Identity`, :func:`private_statement`):
every planned trial has one results row (and a ``result.json`` if finished or pruned); no
finished trial trained again (its ``result.json`` hash and mtime, its checkpoint's mtime, as
first seen); no Optuna trial RUNNING, Optuna's COMPLETE / PRUNED ids = the store's ok / pruned;
the store equals the records; ``dpsweep report`` exits 0; private: the end-to-end epsilon and
statement (summary.json, report, stdout) equal a clean run's (the plan computed here by the
driver's own function: the bound depends on the law, not on interruptions), the secret count
never moves. Exit code 3 (``core.exits``) is a sweep finished with failed trials: counted. Ray's
temp dir is a short private TMPDIR, removed after. Writes ``bench/results/chaos{,_private}.json``.

    .venv/bin/python -m bench.chaos [--part both|asha|private] [--seed 44] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import cli_harness as cli
from bench.harness import load_average, write_results
from dpsweep.core import layout

DRIVER, WORKER, GROUP = "driver", "worker", "group"
KINDS = (DRIVER, WORKER, GROUP)
START, RECORD = "start", "record"
#: Delay ranges (seconds) after the anchor: a start-anchored kill lands anywhere from the imports
#: to the first trials (a command needs 15-25 s to reach its trials on two busy cores).
START_DELAY_S = (1.0, 20.0)
RECORD_DELAY_S = (0.0, 3.0)
WORKER_DELAY_S = (0.0, 1.5)
#: A trial's Ray worker as /proc names it (15 characters of its title), its title in training.
WORKER_COMM = "ray::ImplicitFu"
WORKER_TRAINING = "ray::ImplicitFunc.train"
#: How long a worker fault waits for a trial's worker to appear before it is tried later.
WORKER_WAIT_S = 10.0
POLL_S = 0.05
#: Exit codes of a sweep that ran to its end: everything done, or done with failed trials.
EXIT_OK, EXIT_FAILURES = 0, 3
#: Commands in a row that end neither by a fault nor at the sweep's end before a soak gives up.
MAX_BAD_COMMANDS = 3
STDERR_TAIL_LINES = 20
#: ``tempfile.mkdtemp`` prefix in /tmp: short, so Ray's sockets below it fit (orchestrator.raytemp).
TMP_PREFIX = "cs"
ASHA_TRIALS, ASHA_FAULTS, ASHA_MIN_FAULTS = 160, 18, 15
PRIVATE_EXPECTED_TRIALS, PRIVATE_FAULTS = 24, 9
#: After this many seconds a soak injects no more faults and lets its sweep finish.
ASHA_DEADLINE_S, PRIVATE_DEADLINE_S = 13 * 60, 7 * 60
COMMON = """\
[training]
epochs = {epochs}
batch_size = 50
[sweep]
methods = ["dpsgd"]
max_concurrent_trials = 2
baseline = false
{sweep}
[audit]
enabled = false
"""
ASHA_SWEEP = (f"trials_per_method = {ASHA_TRIALS}\nseed = {{seed}}\npruner = \"asha\"\n"
              "pruner_min_epochs = 1\npruner_factor = 3")
PRIVATE_SWEEP = f"tuning = \"private\"\nexpected_trials = {PRIVATE_EXPECTED_TRIALS}.0"
ASHA_EPOCHS, PRIVATE_EPOCHS = 3, 6


# ---- the schedule ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    anchor: str
    delay_s: float


def fault_schedule(*, seed: int, faults: int, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """``faults`` faults, the kinds as even as the count allows, in a seeded random order with
    seeded anchors and delays: the same seed gives the same soak plan."""
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(faults)]
    rng.shuffle(order)
    out = []
    for index, kind in enumerate(order):
        anchor = RECORD if kind == WORKER else rng.choice((START, RECORD))
        lo, hi = (WORKER_DELAY_S if kind == WORKER
                  else START_DELAY_S if anchor == START else RECORD_DELAY_S)
        out.append(Fault(index=index, kind=kind, anchor=anchor,
                         delay_s=round(rng.uniform(lo, hi), 2)))
    return out


# ---- the run directory ---------------------------------------------------------------------------
def final_records(run: Path) -> dict[str, list[str]]:
    """trial id -> the final record files its folder holds (result.json, error.json)."""
    out: dict[str, list[str]] = {}
    for name in (layout.RESULT, layout.ERROR):
        for path in run.glob(f"{layout.TRIALS}/*/{name}"):
            out.setdefault(path.parent.name, []).append(name)
    return out


def in_flight(run: Path) -> list[str]:
    """Trials with a folder but no final record: the ones a fault interrupts."""
    done = final_records(run)
    return sorted(p.name for p in run.glob(f"{layout.TRIALS}/*")
                  if p.is_dir() and p.name not in done)


def _fingerprint(trial: Path) -> str:
    result = trial / layout.RESULT
    ckpt = trial / layout.CHECKPOINT_DIR / layout.CHECKPOINT_FILE
    parts = [hashlib.sha256(result.read_bytes()).hexdigest(), str(result.stat().st_mtime_ns),
             str(ckpt.stat().st_mtime_ns) if ckpt.is_file() else "-"]
    return ":".join(parts)


class Identity:
    """Each finished trial's record and checkpoint as first seen: a finished trial trained again
    rewrites both (``execute`` writes result.json last)."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.first: dict[str, str] = {}
        self.changed: set[str] = set()
        self.vanished: set[str] = set()

    def observe(self) -> None:
        now = {}
        for path in self.run.glob(f"{layout.TRIALS}/*/{layout.RESULT}"):
            with contextlib.suppress(OSError):
                now[path.parent.name] = _fingerprint(path.parent)
        self.changed |= {t for t, f in self.first.items() if t in now and now[t] != f}
        self.vanished |= {t for t in self.first if t not in now}
        for tid, fp in now.items():
            self.first.setdefault(tid, fp)


#: Fields compared between a result.json and its row: (record key, row column).
OK_FIELDS = (("val_accuracy", "val_accuracy"), ("test_accuracy", "test_accuracy"))
PRUNED_FIELDS = (("val_accuracy", "val_accuracy"), ("pruned_at", "pruned_at"),
                 ("epochs_run", "epochs"))


def store_mismatches(records: Mapping[str, Mapping[str, Any]],
                     rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Where the results store and the trial records disagree, in words ([] when they agree):
    one row per recorded trial, the same status, the same figures."""
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_id.setdefault(str(row["trial_id"]), []).append(row)
    out = [f"{t}: {len(r)} rows" for t, r in sorted(by_id.items()) if len(r) != 1]
    out += [f"{t}: a record, no row" for t in sorted(set(records) - set(by_id))]
    for tid, row_list in sorted(by_id.items()):
        row, record = row_list[0], records.get(tid)
        if record is None:
            if row["status"] != "failed":  # a failed plan may leave no folder, only its row
                out.append(f"{tid}: a {row['status']} row, no record")
            continue
        if row["status"] != record["status"]:
            out.append(f"{tid}: row {row['status']}, record {record['status']}")
            continue
        fields = OK_FIELDS if record["status"] == "ok" else (
            PRUNED_FIELDS if record["status"] == "pruned" else ())
        out += [f"{tid}: {col} row {row[col]!r}, record {record[key]!r}"
                for key, col in fields if float(row[col]) != float(record[key])]
    return out


def check_run(run: Path, *, planned: frozenset[str]) -> dict[str, Any]:
    """The end state of a soak's run directory against its planned trial ids."""
    from dpsweep.reports.store import read_results

    files = final_records(run)
    records = {t: json.loads((run / layout.TRIALS / t / layout.RESULT).read_text())
               if layout.RESULT in names else {"status": "failed"} for t, names in files.items()}
    rows = read_results(run, allow_empty=True).to_dict("records")
    ids = [str(r["trial_id"]) for r in rows]
    statuses = Counter(str(r["status"]) for r in rows)
    status_of = {str(r["trial_id"]): str(r["status"]) for r in rows}
    lost = sorted(t for t in planned if ids.count(t) != 1 or (
        status_of[t] in ("ok", "pruned") and layout.RESULT not in files.get(t, [])))
    trials = cli.optuna_trials(run)
    agrees = all(sorted(t["id"] for t in trials if t["state"] == state)
                 == sorted(t for t, s in status_of.items() if s == status)
                 for state, status in (("COMPLETE", "ok"), ("PRUNED", "pruned")))
    return {
        "planned": len(planned), "rows": len(rows), "ok": statuses.get("ok", 0),
        "pruned": statuses.get("pruned", 0), "failed": statuses.get("failed", 0),
        "lost": lost, "two_final_records": sorted(t for t, n in files.items() if len(n) > 1),
        "unplanned": sorted((set(ids) | set(files)) - planned),
        "store_mismatches": store_mismatches(records, rows),
        "running_left": [f"{s}#{n} ({t})" for s, n, t in cli.running(trials)],
        "optuna_states": dict(Counter(t["state"] for t in trials)),
        "optuna_interrupted": sum(bool(t["attrs"].get("interrupted")) for t in trials),
        "optuna_agrees": agrees,
        "failures": {str(r["trial_id"]): str(r["error"]) for r in rows
                     if r["status"] == "failed"},
    }


def planned_ids(config: Path, run: Path) -> frozenset[str]:
    """The trial ids the config plans (with private tuning: the secret counts the run drew)."""
    from dpsweep.orchestrator.api import load_config as load
    from dpsweep.orchestrator.door import check
    from dpsweep.orchestrator.sweep.plans import study_plans

    counts = None
    if (run / layout.PRIVATE_TUNING).is_file():
        counts = json.loads((run / layout.PRIVATE_TUNING).read_text())["counts"]
    plans = study_plans(check(load(config)), counts=counts)
    return frozenset(p.trial_id(i) for p in plans for i in range(p.n_trials))


# ---- injecting --------------------------------------------------------------------------------
@dataclass
class Injected:
    """One fault as it happened."""

    index: int
    kind: str
    anchor: str
    delay_s: float
    command: int
    at_s: float = 0.0  # seconds after the command started
    soak_s: float = 0.0  # seconds after the soak started
    target: str = ""  # what received SIGKILL
    records_before: int = 0  # final records when it landed
    in_flight: list[str] = field(default_factory=list)


def trial_workers(sid: int) -> dict[int, str]:
    """This command's Ray workers that hold a trial: pid -> process title."""
    out = {}
    for pid, info in cli.processes().items():
        if info.session == sid and info.name == WORKER_COMM and info.state != "Z":
            with contextlib.suppress(OSError):
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    return out


def _moment(proc: cli.Proc, fault: Fault, *, run: Path) -> bool:
    """Wait for the fault's anchor, then its delay; False when the command ended first (or no
    record came within STAGE_TIMEOUT: a hang, which the caller sees as a live command)."""
    if fault.anchor == RECORD:
        before = len(final_records(run))
        if not cli.wait_for(proc, lambda: len(final_records(run)) > before,
                            timeout=cli.STAGE_TIMEOUT):
            return False
    end = time.monotonic() + fault.delay_s
    cli.wait_for(proc, lambda: time.monotonic() >= end, timeout=fault.delay_s + 1)
    return proc.popen.poll() is None


def _pick_worker(proc: cli.Proc, rng: random.Random) -> tuple[int, str] | None:
    """A worker training a trial, chosen by ``rng``; after WORKER_WAIT_S without one, any trial
    worker (between two trials); None when the command has none."""
    deadline = time.monotonic() + WORKER_WAIT_S
    while proc.popen.poll() is None:
        workers = {p: t for p, t in trial_workers(proc.pid).items() if t}
        training = sorted(p for p, title in workers.items() if title == WORKER_TRAINING)
        pool = training or (sorted(workers) if time.monotonic() > deadline else [])
        if pool:
            pid = rng.choice(pool)
            return pid, workers[pid]
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    return None


def inject(proc: cli.Proc, fault: Fault, *, rng: random.Random) -> str | None:
    """SIGKILL what the fault names; what received it, or None when nothing could be hit."""
    if fault.kind == WORKER:
        picked = _pick_worker(proc, rng)
        if picked is None:
            return None
        pid, title = picked
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            return f"{title} pid {pid}"
        return None
    if proc.popen.poll() is not None:
        return None
    if fault.kind == GROUP:
        os.killpg(proc.pid, signal.SIGKILL)
        return f"process group {proc.pid}"
    os.kill(proc.pid, signal.SIGKILL)
    return f"dpsweep pid {proc.pid}"


# ---- the soak ----------------------------------------------------------------------------------
@dataclass
class Command:
    index: int
    command: str
    rc: int | None = None  # None: killed after STAGE_TIMEOUT (a hang)
    seconds: float = 0.0
    faults: list[str] = field(default_factory=list)  # the kinds injected into it, in order
    stopped_by_fault: bool = False
    hung: bool = False  # no record for STAGE_TIMEOUT while a fault waited for one
    records_after: int = 0
    load_average: float = 0.0  # when it ended
    leftover: dict[int, str] = field(default_factory=dict)  # alive after the grace
    stderr_tail: str = ""  # when it ended neither by a fault nor at the sweep's end


@dataclass
class Soak:
    """A soak's state: where it runs, what is left to inject, what happened."""

    run: Path
    config: Path
    logs: Path
    env: dict[str, str]
    pending: list[Fault]
    deadline: float
    rng: random.Random
    identity: Identity
    began: float = field(default_factory=time.monotonic)
    injected: list[Injected] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    printed: list[str] = field(default_factory=list)  # stdout lines naming the private plan
    counts_seen: list[dict[str, int]] = field(default_factory=list)


def _faults_in(soak: Soak, proc: cli.Proc, cmd: Command, *, began: float) -> bool:
    """Inject pending faults into the live command; True when one stopped it. A command that
    wrote no record for STAGE_TIMEOUT while a record-anchored fault waited is marked hung."""
    while soak.pending and time.monotonic() < soak.deadline and proc.popen.poll() is None:
        fault = soak.pending[0]
        if not _moment(proc, fault, run=soak.run):
            cmd.hung = proc.popen.poll() is None
            return False
        records = len(final_records(soak.run))
        target = inject(proc, fault, rng=soak.rng)
        if target is None:
            continue  # no worker held a trial at that moment: the same fault, a later moment
        soak.pending.pop(0)
        now = time.monotonic()
        soak.injected.append(Injected(
            index=fault.index, kind=fault.kind, anchor=fault.anchor, delay_s=fault.delay_s,
            command=cmd.index, at_s=round(now - began, 2), soak_s=round(now - soak.began, 2),
            target=target, records_before=records, in_flight=in_flight(soak.run)))
        cmd.faults.append(fault.kind)
        if fault.kind != WORKER:
            return True
    return False


def one_command(soak: Soak) -> Command:
    """One run/resume: the faults due while it lives, then its end, reaped and observed."""
    args = (["resume", str(soak.run)] if soak.run.is_dir()
            else ["run", str(soak.config), "--out", str(soak.run)])
    cmd = Command(index=len(soak.commands) + 1, command=args[0])
    began = time.monotonic()
    proc = cli.start(args, log=soak.logs / f"{cmd.index:02d}-{args[0]}", env=soak.env)
    stopped = False
    try:
        stopped = _faults_in(soak, proc, cmd, began=began)
        cmd.rc = cli.finish(proc, timeout=0 if cmd.hung else cli.STAGE_TIMEOUT)
    finally:
        cmd.leftover = cli.reap(proc, grace=cli.KILL_GRACE if stopped else 10.0)
    cmd.stopped_by_fault = stopped
    cmd.seconds, cmd.load_average = round(time.monotonic() - began, 2), load_average()
    cmd.records_after = len(final_records(soak.run)) if soak.run.is_dir() else 0
    soak.printed += [ln for ln in proc.stdout().splitlines() if ln.startswith(PLAN_LINE)]
    if not stopped and cmd.rc not in (EXIT_OK, EXIT_FAILURES):
        cmd.stderr_tail = "\n".join(proc.stderr().splitlines()[-STDERR_TAIL_LINES:])
    if soak.run.is_dir():
        soak.identity.observe()
        counts = soak.run / layout.PRIVATE_TUNING
        if counts.is_file():
            soak.counts_seen.append(json.loads(counts.read_text())["counts"])
    return cmd


def drive(soak: Soak) -> str:
    """Commands until the sweep ran to its end: '' then, else why the soak stopped."""
    bad = 0
    while True:
        cmd = one_command(soak)
        soak.commands.append(cmd)
        print(f"  {cmd.index:>2} {cmd.command:<6} rc {cmd.rc!s:>4} {cmd.seconds:6.1f} s  faults "
              f"{','.join(cmd.faults) or '-':<22} records {cmd.records_after:>3}  "
              f"{time.monotonic() - soak.began:6.0f} s in", flush=True)
        if cmd.stopped_by_fault:
            bad = 0
            continue
        if cmd.rc in (EXIT_OK, EXIT_FAILURES):
            return ""
        bad += 1
        print(f"  command {cmd.index} ended {cmd.rc} without a fault:\n{cmd.stderr_tail}",
              flush=True)
        if cmd.rc is None or cmd.hung:
            return (f"command {cmd.index} ({cmd.command}) hung: no record in "
                    f"{cli.STAGE_TIMEOUT:.0f} s")
        if bad >= MAX_BAD_COMMANDS:
            return f"{bad} commands in a row ended {cmd.rc} without a fault"


# ---- after the soak -----------------------------------------------------------------------------
PLAN_LINE = "private tuning:"


def private_statement(config: Path, run: Path, *, printed: list[str]) -> dict[str, Any]:
    """The soaked run's tuning statement against the one a clean run of its config states
    (computed by the function the driver calls), in summary.json, the report and on stdout."""
    from dpsweep.orchestrator.api import load_config as load
    from dpsweep.orchestrator.door import check
    from dpsweep.orchestrator.sweep.tuning import private_tuning_plan

    clean = private_tuning_plan(check(load(config))).to_dict()
    after = json.loads((run / layout.SUMMARY).read_text()).get("tuning") or {}
    page = run / layout.REPORT / "report.html"
    shown = f"epsilon = {clean['end_to_end_epsilon']:.4g}"
    line = f"{PLAN_LINE} end-to-end epsilon {clean['end_to_end_epsilon']:.4f} "
    keys = ("end_to_end_epsilon", "per_trial_epsilon", "statement")
    return {
        "clean": {k: clean[k] for k in keys}, "after": {k: after.get(k) for k in keys},
        "equal": all(after.get(k) == clean[k] for k in keys),
        "report_shows": page.is_file() and shown in page.read_text(),
        "printed": len(printed), "printed_agree": all(p.startswith(line) for p in printed),
    }


def report(run: Path, *, logs: Path, env: dict[str, str]) -> tuple[int | None, float]:
    """``dpsweep report RUN_DIR``: its exit code and seconds."""
    began = time.monotonic()
    proc = cli.start(["report", str(run)], log=logs / "report", env=env)
    try:
        rc = cli.finish(proc, timeout=cli.STAGE_TIMEOUT)
    finally:
        cli.reap(proc, grace=10.0)
    return rc, round(time.monotonic() - began, 2)


def verdict(out: Mapping[str, Any], *, min_faults: int) -> list[str]:
    """What failed the soak, in words ([] when it held)."""
    c = out["checks"]
    bad = [f"{k}: {c[k]}" for k in ("lost", "two_final_records", "unplanned",
                                     "store_mismatches", "running_left") if c[k]]
    bad += [f"{k}: {out[k]}" for k in ("trained_twice", "records_vanished") if out[k]]
    if not c["optuna_agrees"]:
        bad.append("Optuna's COMPLETE/PRUNED ids differ from the store's ok/pruned ids")
    if out["stopped"]:
        bad.append(out["stopped"])
    if out["final_rc"] not in (EXIT_OK, EXIT_FAILURES):
        bad.append(f"final exit code {out['final_rc']}")
    if out["report_rc"] != EXIT_OK:
        bad.append(f"dpsweep report exited {out['report_rc']}")
    if sum(out["faults_by_kind"].values()) < min_faults:
        bad.append(f"{sum(out['faults_by_kind'].values())} faults injected (< {min_faults})")
    if out["leftover_processes"]:
        bad.append(f"{out['leftover_processes']} processes alive "
                   f"{cli.KILL_GRACE:.0f} s after a kill")
    private = out.get("private") or {}
    if private and not (private["equal"] and private["report_shows"]
                        and private["printed_agree"]):
        bad.append("the private-tuning statement changed")
    if private and not private["trial_count_unchanged"]:
        bad.append(f"the secret trial count changed: {private['counts_seen']}")
    return bad


# ---- a soak, end to end -----------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    name: str  # also the results file: bench/results/<name>.json
    config: str
    faults: int
    min_faults: int
    deadline_s: float


PARTS = {
    "asha": Part("chaos", COMMON.format(epochs=ASHA_EPOCHS, sweep=ASHA_SWEEP), ASHA_FAULTS,
                 ASHA_MIN_FAULTS, ASHA_DEADLINE_S),
    "private": Part("chaos_private", COMMON.format(epochs=PRIVATE_EPOCHS, sweep=PRIVATE_SWEEP),
                    PRIVATE_FAULTS, 1, PRIVATE_DEADLINE_S),
}


def end_state(soak: Soak) -> dict[str, Any]:
    """The run directory after the soak: the checks, the attempts, the private statement."""
    run = soak.run
    summary = json.loads((run / layout.SUMMARY).read_text())
    out: dict[str, Any] = {
        "checks": check_run(run, planned=planned_ids(soak.config, run)),
        "attempts": [a.get("ended") for a in json.loads((run / layout.ATTEMPTS).read_text())],
        "tuning_summary": summary.get("tuning")}
    if (run / layout.PRIVATE_TUNING).is_file():
        seen = soak.counts_seen
        out["tuning_summary"] = None  # the statement is under "private"
        out["private"] = {**private_statement(soak.config, run, printed=soak.printed),
                          "counts_seen": seen[:1] + [c for c in seen[1:] if c != seen[0]],
                          "trial_count_unchanged": all(c == seen[0] for c in seen)}
    return out


def soak_part(part: Part, *, work: Path, seed: int, env: dict[str, str]) -> dict[str, Any]:
    """One soak in ``work``: the commands, the report, the checks and the verdict."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    config = work / "sweep.toml"
    config.write_text(part.config.format(seed=seed))
    schedule = fault_schedule(seed=seed, faults=part.faults)
    load = [load_average()]
    soak = Soak(run=work / "run", config=config, logs=logs, env=env, pending=list(schedule),
                deadline=time.monotonic() + part.deadline_s, rng=random.Random(seed),
                identity=Identity(work / "run"))
    print(f"{part.name}: {len(schedule)} faults planned (seed {seed})", flush=True)
    stopped = drive(soak)
    rc, report_s = report(soak.run, logs=logs, env=env)
    soak.identity.observe()
    load.append(load_average())
    out: dict[str, Any] = {
        "config": config.read_text(), "seed": seed, "stopped": stopped,
        "schedule": [asdict(f) for f in schedule],
        "faults_by_kind": dict(Counter(f.kind for f in soak.injected)),
        "faults_not_injected": [asdict(f) for f in soak.pending],
        "faults": [asdict(f) for f in soak.injected],
        "commands": [asdict(c) for c in soak.commands],
        "resumes": sum(c.command == "resume" for c in soak.commands),
        "exit_codes": [c.rc for c in soak.commands], "final_rc": soak.commands[-1].rc,
        "trained_twice": sorted(soak.identity.changed),
        "records_vanished": sorted(soak.identity.vanished),
        "report_rc": rc, "report_seconds": report_s,
        "leftover_processes": sum(len(c.leftover) for c in soak.commands),
        "wall_s": round(time.monotonic() - soak.began, 1), "load_average_before_after": load}
    try:
        out.update(end_state(soak))
        out["problems"] = verdict(out, min_faults=part.min_faults)
    except Exception as exc:  # a run directory the checks cannot read is itself the finding
        out["problems"] = [stopped or f"the run directory could not be checked: {exc!r}"]
    out["ok"] = not out["problems"]
    return out


def summary_line(name: str, out: Mapping[str, Any]) -> str:
    c = out.get("checks") or {}
    counts = ", ".join(f"{k} {c.get(k)}" for k in ("planned", "ok", "pruned", "failed"))
    return (f"{name}: faults {out['faults_by_kind']} ({len(out['faults_not_injected'])} not "
            f"injected), {out['resumes']} resumes, exit codes {out['exit_codes']}; trials "
            f"{counts}; lost {c.get('lost')}, trained twice {out['trained_twice']}, RUNNING "
            f"{c.get('running_left')}, store = records {not c.get('store_mismatches')}, "
            f"report rc {out['report_rc']}; {out['wall_s']:.0f} s: "
            f"{'OK' if out['ok'] else 'PROBLEMS: ' + '; '.join(out['problems'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("both", *PARTS), default="both")
    ap.add_argument("--seed", type=int, default=44, help="the fault schedule's and sweep's seed")
    ap.add_argument("--workdir", type=Path,
                    help="keep the run directories and logs here (a new or empty directory; "
                         "default: a temporary one, removed)")
    args = ap.parse_args()
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        ap.error(f"--workdir {args.workdir} is not empty")
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir="/tmp"))
    work, env = args.workdir or tmp / "work", {"TMPDIR": str(tmp)}
    try:
        for key in (("asha", "private") if args.part == "both" else (args.part,)):
            out = soak_part(PARTS[key], work=work / key, seed=args.seed, env=env)
            print(summary_line(key, out), flush=True)
            print(f"wrote {write_results(PARTS[key].name, out)}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
