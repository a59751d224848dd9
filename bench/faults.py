"""Repeated ``kill -9`` of the sweep driver and ``resume``, on the real CLI: what each crash costs.

Writes a small sweep config (two methods, audit off, the non-private baseline on: the shape of
``tests/system/test_faults.py``'s CONFIG, with enough trials per method for every kill to land while
trials remain), starts ``dpsweep run`` on it and then, for ``--kills`` cycles: waits until at
least one more trial has finished (a new ``trials/*/result.json``), sends SIGKILL to the driver's
pid alone (as ``kill -9 PID`` would; its Ray processes must go by themselves, by Ray's fate
sharing), gives them ``KILL_GRACE`` seconds, kills and records whatever else of the command is
still alive, and starts ``dpsweep resume RUN_DIR``. The last resume runs to the end.

After every cycle, from the run directory alone (the helpers are ``tests/system/test_faults.py``'s):

* finished: trial ids with a ``result.json``;
* redone: trials whose ``result.json`` changed after it was first seen (a finished trial trained
  again: ``execute`` rewrites it), cumulative;
* lost: trials once finished whose ``result.json`` is gone, and at the end every expected id
  (search trials and the baseline) without one, or without exactly one row in the results store;
* running: Optuna trials left RUNNING by this crash (a kill -9 leaves the trials it was running
  RUNNING; the next resume must reconcile them), and ``stale``: those still RUNNING after the
  next cycle, i.e. a resume that did not reconcile them (must be 0, and RUNNING 0 at the end).

Table and totals on stdout; everything in ``bench/results/faults.json``.

    .venv/bin/python -m bench.faults [--kills 10] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.cli_harness import (
    KILL_GRACE,
    STAGE_TIMEOUT,
    Proc,
    complete_ids,
    finish,
    optuna_trials,
    reap,
    result_ids,
    result_mtimes,
    running,
    start,
    wait_for,
)
from bench.harness import load_average, write_results

METHODS = ("dpsgd", "auto_s")
EPOCHS = 3
CONCURRENT = 2
#: Trials per method at least (``tests/system/test_faults.py``'s size).
MIN_TRIALS_PER_METHOD = 4
#: Lines of a failed command's stderr shown.
ERROR_TAIL_LINES = 30
CONFIG = """\
[training]
epochs = {epochs}
[sweep]
methods = [{methods}]
trials_per_method = {trials}
max_concurrent_trials = {concurrent}
baseline = true
[audit]
enabled = false
"""


def trials_per_method(kills: int) -> int:
    """Enough trials that every cycle can see a new one finish: each cycle uses up at least one
    finished trial, two when the concurrent pair finish together, so ``kills`` trials per method
    (of two methods) always leave one to do after the last kill."""
    return max(MIN_TRIALS_PER_METHOD, kills)


def expected_ids(config: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(search trial ids, every id including the baseline) of the config, as the driver names
    them (``orchestrator.sweep.plans.study_plans``)."""
    from dpsweep.orchestrator.api import load_config as load
    from dpsweep.orchestrator.door import check
    from dpsweep.orchestrator.sweep.jobs import BASELINE_ID
    from dpsweep.orchestrator.sweep.plans import study_plans

    plans = study_plans(check(load(config)))
    search = frozenset(p.trial_id(i) for p in plans for i in range(p.n_trials))
    return search, search | {BASELINE_ID}


@dataclass
class Cycle:
    """One command (``run`` or ``resume``) and the run directory's state after it."""

    cycle: int
    command: str
    killed: bool = False  # the moment came and SIGKILL was sent
    rc: int | None = None
    seconds: float = 0.0
    kill_at: float = 0.0  # seconds after the command started
    finished: int = 0
    new: int = 0  # finished during this command (until everything it started was gone)
    redone: list[str] = field(default_factory=list)  # cumulative
    lost: list[str] = field(default_factory=list)  # once finished, result.json now gone
    running: list[str] = field(default_factory=list)  # Optuna RUNNING after the command
    stale: list[str] = field(default_factory=list)  # RUNNING after this and the previous one
    leftover: dict[int, str] = field(default_factory=dict)  # processes alive after the grace


class Tracker:
    """What the run directory looked like before: first-seen result.json mtimes, RUNNING set."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.first_seen: dict[str, int] = {}
        self.redone: set[str] = set()
        self.prev_running: set[tuple[str, int]] = set()

    def observe(self, cycle: Cycle) -> None:
        now = result_mtimes(self.run)
        self.redone |= {t for t, m in self.first_seen.items() if t in now and now[t] != m}
        cycle.lost = sorted(t for t in self.first_seen if t not in now)
        cycle.new = sum(t not in self.first_seen for t in now)
        for t, m in now.items():
            self.first_seen.setdefault(t, m)
        cycle.finished, cycle.redone = len(now), sorted(self.redone)
        left = running(optuna_trials(self.run))
        cycle.running = sorted(f"{study}#{number} ({tid})" for study, number, tid in left)
        keys = {(study, number) for study, number, _ in left}
        cycle.stale = sorted(f"{s}#{n}" for s, n in keys & self.prev_running)
        self.prev_running = keys


def one_cycle(index: int, args: list[str], *, run: Path, logs: Path, kill: bool,
              tracker: Tracker) -> Cycle:
    """Run one command; with ``kill``, SIGKILL the driver once one more trial has finished."""
    cycle = Cycle(cycle=index, command=args[0])
    before = len(result_mtimes(run)) if run.is_dir() else 0
    began = time.monotonic()
    proc: Proc = start(args, log=logs / f"{index:02d}-{args[0]}")
    try:
        if kill:
            came = wait_for(proc, lambda: run.is_dir() and len(result_mtimes(run)) > before,
                            timeout=STAGE_TIMEOUT)
            cycle.kill_at = time.monotonic() - began
            if came and proc.popen.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                cycle.killed = True
        cycle.rc = finish(proc, timeout=STAGE_TIMEOUT)
    finally:
        cycle.leftover = reap(proc, grace=KILL_GRACE if cycle.killed else 10.0)
    cycle.seconds = time.monotonic() - began
    if cycle.rc not in (0, -signal.SIGKILL):
        tail = proc.stderr().splitlines()[-ERROR_TAIL_LINES:]
        print(f"cycle {index} ({args[0]}) exited {cycle.rc}:\n" + "\n".join(tail), flush=True)
    tracker.observe(cycle)
    return cycle


HEADER = (f"{'cycle':>5} {'command':>7} {'killed at s':>11} {'rc':>4} {'finished':>8} "
          f"{'new':>4} {'redone':>6} {'lost':>4} {'running':>7} {'stale':>5} {'leftover':>8}")


def row(c: Cycle) -> str:
    killed = f"{c.kill_at:.1f}" if c.killed else "-"
    return (f"{c.cycle:>5} {c.command:>7} {killed:>11} {c.rc!s:>4} {c.finished:>8} {c.new:>4} "
            f"{len(c.redone):>6} {len(c.lost):>4} {len(c.running):>7} {len(c.stale):>5} "
            f"{len(c.leftover):>8}")


def chain(work: Path, *, kills: int, trials: int) -> dict[str, Any]:
    """The whole experiment in ``work``: config, run, the kill/resume cycles, the last resume."""
    config, run, logs = work / "sweep.toml", work / "run", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    config.write_text(CONFIG.format(epochs=EPOCHS, trials=trials, concurrent=CONCURRENT,
                                    methods=", ".join(f'"{m}"' for m in METHODS)))
    search, everything = expected_ids(config)
    tracker = Tracker(run)
    cycles: list[Cycle] = []
    began = time.monotonic()
    print(HEADER, flush=True)
    for index in range(1, kills + 1):
        args = ["run", str(config), "--out", str(run)] if index == 1 else ["resume", str(run)]
        cycles.append(one_cycle(index, args, run=run, logs=logs, kill=True, tracker=tracker))
        print(row(cycles[-1]), flush=True)
        if not cycles[-1].killed:  # the sweep ended (or failed) before the moment came
            break
    if cycles[-1].killed:
        cycles.append(one_cycle(len(cycles) + 1, ["resume", str(run)], run=run, logs=logs,
                                kill=False, tracker=tracker))
        print(row(cycles[-1]), flush=True)
    final_files = set(result_mtimes(run))
    store = result_ids(run)
    trials_final = optuna_trials(run)
    totals = {
        "kills": sum(c.killed for c in cycles),
        "kills_asked": kills,
        "final_rc": cycles[-1].rc,
        "expected": len(everything),
        "finished": len(final_files & everything),
        "redone": sorted(tracker.redone),
        "lost": sorted(everything - final_files),
        "missing_rows": sorted(everything - set(store)),
        "duplicate_rows": sorted({t for t in store if store.count(t) > 1}),
        "unexpected": sorted(final_files - everything),
        "optuna_complete_equals_search": complete_ids(trials_final) == sorted(search),
        "running_at_end": len(running(trials_final)),
        "stale_running": sorted({s for c in cycles for s in c.stale}),
        "leftover_processes": sum(len(c.leftover) for c in cycles),
        "seconds": time.monotonic() - began,
    }
    return {"cycles": [asdict(c) for c in cycles], "totals": totals,
            "config": config.read_text()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10, help="kill -9 / resume cycles")
    ap.add_argument("--trials-per-method", type=int,
                    help="trials per method (default: max(4, --kills), so every kill can land "
                         "while trials remain)")
    ap.add_argument("--workdir", type=Path,
                    help="keep the run directory and the commands' logs here (a new or empty "
                         "directory; default: a temporary one, removed)")
    args = ap.parse_args()
    if args.kills < 1:
        ap.error("--kills must be >= 1")
    trials = args.trials_per_method or trials_per_method(args.kills)
    load = [load_average()]
    if args.workdir is not None:
        if args.workdir.exists() and any(args.workdir.iterdir()):
            ap.error(f"--workdir {args.workdir} is not empty")
        out = chain(args.workdir, kills=args.kills, trials=trials)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = chain(Path(tmp), kills=args.kills, trials=trials)
    load.append(load_average())
    t = out["totals"]
    print(f"\n{t['kills']} of {t['kills_asked']} kills landed; final resume exit {t['final_rc']}; "
          f"{t['finished']} of {t['expected']} trials finished in {t['seconds']:.0f} s (load "
          f"average {load[0]:.1f} -> {load[1]:.1f})")
    print(f"redone {len(t['redone'])}, lost {len(t['lost'])}, results-store rows missing "
          f"{len(t['missing_rows'])} / duplicated {len(t['duplicate_rows'])}, Optuna RUNNING at "
          f"the end {t['running_at_end']}, never reconciled {len(t['stale_running'])}, Optuna "
          f"COMPLETE = search trials: {t['optuna_complete_equals_search']}, processes alive "
          f"{KILL_GRACE:.0f} s after a kill {t['leftover_processes']}")
    ok = (t["final_rc"] == 0 and not t["redone"] and not t["lost"] and not t["missing_rows"]
          and not t["duplicate_rows"] and t["running_at_end"] == 0 and not t["stale_running"]
          and t["optuna_complete_equals_search"] and t["leftover_processes"] == 0)
    print(f"nothing lost, redone or left RUNNING: {'yes' if ok else 'NO'}")
    path = write_results("faults", {**out, "ok": ok, "kills": args.kills,
                                    "trials_per_method": trials, "methods": list(METHODS),
                                    "epochs": EPOCHS, "load_average_before_after": load})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
