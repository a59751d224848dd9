"""How strong is the membership audit, per plan, on a target that memorises (issue 41, item 4).

The target is the test suite's leaky digits model (``tests/unit/orchestrator/test_audit.py``):
scikit-learn digits, 300 members (the train split), the "auto" network (``digits_cnn``)
trained by ``trainables.audit.references.train_nonprivate`` (plain Adam, no clipping or noise,
100 epochs: train accuracy 1.0). Non-members are the 300 examples of the holdout split, the
public shadow pool has 800. The audit's pieces are driven directly, in this process, exactly as
``orchestrator.audit.membership.audit_model`` assembles them (plan, layer probes, the shadow
classifier wrapped around the reference trainer, ``collect_signals``, ``score_signals``); no
Ray, no sweep. Plans (``PLAN_ROWS``):

* ``offline-4``: ``[audit] references = "offline"``, ``reference_models = 4``: 4 references
  trained on the public pool;
* ``online-4``, the code's default for one trial (``references = "online"``,
  ``reference_models = 4``), and ``online-16``: references trained on halves of members +
  non-members. The first 4 references of the 16-reference online plan *are* the 4-reference
  plan (the same candidates, training rows and seeds: ``plan_references`` pairs reference 2i
  and 2i+1 on one permutation, ``reference_seed`` depends on the index only), so one
  16-reference training serves both rows (the bench checks the masks agree);
* ``online-4, pooled over a 4-trial study`` (``POOLED_ROW``), the default in a sweep
  (``audit.share_references = "study"``): the target's own 4 references (the default plan's)
  pooled with 4 from each of 3 other trials of its study, which train with another learning
  rate (1e-3, 1e-2) or fewer epochs at a larger batch (30 at 64), as a search's trials differ:
  each trial still trains 4 references, and the pooled plan differs from ``online-16`` only in
  those recipes (the same halves and seeds, checked).

Per plan and attack (``lira_online`` — the plain online LiRA, only with online references —,
``lira_pooled`` — online LiRA with its IN - OUT shift pooled over candidates of similar
difficulty, also online only —, ``lira_offline``, ``rmia``, the uncalibrated
``loss_threshold``, and the ``shadow_classifier``, per layer only): TPR at 1% and 0.1% FPR and
AUC on the output loss (RMIA reads the output's true-class probability, the same for loss and
logit, so it runs on ``logit``), and on the best layer (the per-layer signal — gradient norm,
probe loss or shadow classifier's sorted representation — with the highest TPR at 1% FPR: an
oracle pick, optimistic like any maximum). ``strongest`` is the best cell of the plan over
every signal and attack. TPR at a target FPR uses the audit's rule
(``trainables.audit.stats.attacks``): threshold at the (k+1)-th largest non-member score, k the
most false positives the FPR allows, members strictly above it; with 300 non-members 0.1% FPR
allows none (k = 0: the TPR above every non-member), so that figure is flagged not meaningful.
Scores pass through float32 first, as the audit stores them.

Every seed re-draws the data split, the target's training seed, and the audit seed (candidates,
reference training sets and seeds); repeat 0 is the test suite's setup (data seed 0, target
seed 12345) with audit seed 0. Reported: median and range over seeds, and per plan the
reference trainings and seconds (one torch thread).

Run from the repository root: ``.venv/bin/python -m bench.audit_strength [--seeds N]
[--epochs E] [--dump DIR]``; writes ``bench/results/audit_strength.json``. 21 model trainings of
~2 s per seed. ``--dump DIR`` also saves each seed's signals and cells (:func:`dump_seed`) for
``bench/audit_strength_rescore.py``, which re-scores a variant of ``lira_pooled`` on them in
seconds instead of retraining the references.

Results: ``bench/results/audit_strength.json`` and its generated table in docs/audit.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpsweep.trainables.audit.plan_statement import POOLED, POOLED_PER_TRIAL
from dpsweep.trainables.audit.stats.attacks import max_false_positives

#: (row, plan kind, references trained, references used).
PLAN_ROWS = (("offline-4", "offline", 4, 4), ("online-4 (default)", "online", 16, 4),
             ("online-16", "online", 16, 16))
#: The pooled row (``orchestrator.audit.pooling``): the default plan's 4 references of the
#: target's own trial, pooled with 4 from each other trial of a study whose trials differ from
#: the target's recipe as a search's do: (learning rate, epochs, batch size) per extra trial.
POOLED_ROW = "online-4, pooled over a 4-trial study"
POOLED_KIND = POOLED
STUDY_RECIPES = ((1e-3, None, None), (1e-2, None, None), (None, 30, 64))
#: References each trial of the pooled study trains (the default plan's).
PER_TRIAL = POOLED_PER_TRIAL
#: The FPRs the audit reports TPR at.
FPRS = (0.01, 0.001)
FPR_LABELS = {0.01: "tpr_at_1pct", 0.001: "tpr_at_01pct"}
#: The test suite's leaky target: its splits, recipe and target seed.
SPLIT_SIZES = {"train": 300, "validation": 100, "holdout": 300, "test": 297, "shadow": 800}
EPOCHS = 100
LR = 3e-3
BATCH = 32
TARGET_SEED = 12345
DEFAULT_SEEDS = 10
SHADOW = "shadow_classifier"
LOSS_THRESHOLD = "loss_threshold"
#: The output signals (their layer is "output").
OUTPUT_SIGNALS = ("loss", "logit")


# --- pure parts (tests/unit/bench/test_audit_strength.py) ------------------------------------


def as_stored(scores: Any) -> np.ndarray:
    """Scores as the audit stores and evaluates them: float32 (clipped to its range)."""
    big = float(np.finfo(np.float32).max)
    return np.clip(np.asarray(scores, dtype=np.float64), -big, big).astype(np.float32) \
        .astype(np.float64)


def tpr_at_fpr(scores: Any, labels: Any, fpr: float) -> tuple[float, bool]:
    """(TPR, meaningful) at ``fpr`` by the audit's rule: the threshold is the (k+1)-th largest
    non-member score, k = the audit's ``max_false_positives``, and a member counts when its score is
    strictly above it. Meaningful when the non-members allow at least one false positive."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    members, nonmembers = s[y], s[~y]
    if len(members) == 0 or len(nonmembers) == 0:
        raise ValueError("TPR at FPR needs members and non-members")
    k = max_false_positives(fpr, len(nonmembers))
    threshold = np.sort(nonmembers)[::-1][k]
    return float(np.count_nonzero(members > threshold) / len(members)), \
        len(nonmembers) * fpr >= 1


def roc_auc(scores: Any, labels: Any) -> float:
    """Area under the ROC curve (Mann-Whitney; ties count half)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        raise ValueError("AUC needs members and non-members")
    order = np.argsort(s, kind="stable")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    # average ranks of ties (1-based)
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_s)) + 1]
    ends = np.r_[starts[1:], len(s)]
    for a, b in zip(starts, ends, strict=True):
        ranks[order[a:b]] = (a + b + 1) / 2
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def cell_metrics(scores: Any, labels: Any) -> dict[str, Any]:
    """TPR at each of ``FPRS`` (with its meaningful flag) and AUC of one attack's scores."""
    s = as_stored(scores)
    out: dict[str, Any] = {}
    for fpr in FPRS:
        tpr, meaningful = tpr_at_fpr(s, labels, fpr)
        out[FPR_LABELS[fpr]] = tpr
        out[f"{FPR_LABELS[fpr]}_meaningful"] = meaningful
    out["auc"] = roc_auc(s, labels)
    return out


def best_cell(cells: Mapping[str, Mapping[str, Any]]) -> tuple[str, Mapping[str, Any]] | None:
    """The cell with the highest TPR at 1% FPR (ties: higher AUC, then name order)."""
    if not cells:
        return None
    name = max(sorted(cells), key=lambda k: (cells[k]["tpr_at_1pct"], cells[k]["auc"]))
    return name, cells[name]


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of the per-seed values (and the values)."""
    v = [float(x) for x in values]
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v}


#: Metrics aggregated over seeds per (plan, attack, view).
METRICS = ("tpr_at_1pct", "tpr_at_01pct", "auc")


def aggregate(runs: Sequence[Mapping[str, Mapping[str, Mapping[str, Any]]]]
              ) -> dict[str, dict[str, Any]]:
    """Per-seed views {attack: {view: metrics}} -> {attack: {view: {metric: spread}}}, over
    the (attack, view) pairs present in every seed; the view's chosen cell names are listed."""
    keys = [(a, v) for a, views in runs[0].items() for v in views
            if all(v in r.get(a, {}) for r in runs)]
    out: dict[str, dict[str, Any]] = {}
    for attack, view in keys:
        cells = [r[attack][view] for r in runs]
        entry: dict[str, Any] = {m: spread([c[m] for c in cells]) for m in METRICS}
        entry["tpr_at_01pct_meaningful"] = all(c["tpr_at_01pct_meaningful"] for c in cells)
        if any("cell" in c for c in cells):
            entry["cells"] = [c.get("cell") for c in cells]
        out.setdefault(attack, {})[view] = entry
    return out


def views(cells: Mapping[tuple[str, str], Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{(signal, attack): metrics} of one plan and seed -> {attack: {view: metrics}} with views
    ``output_loss`` (RMIA: ``logit``, the same probability), ``output_logit`` (LiRA),
    ``best_layer`` (best per-layer signal), and the plan's ``strongest`` cell (attack "any")."""
    out: dict[str, dict[str, Any]] = {}
    attacks = sorted({a for _, a in cells})
    for attack in attacks:
        mine = {s: m for (s, a), m in cells.items() if a == attack}
        v: dict[str, Any] = {}
        if "loss" in mine:
            v["output_loss"] = dict(mine["loss"])
        elif "logit" in mine:
            v["output_loss"] = {**mine["logit"], "cell": "logit"}
        if "logit" in mine and "loss" in mine:
            v["output_logit"] = dict(mine["logit"])
        best = best_cell({s: m for s, m in mine.items() if s not in OUTPUT_SIGNALS})
        if best is not None:
            v["best_layer"] = {**best[1], "cell": best[0]}
        out[attack] = v
    strongest = best_cell({f"{a}/{s}": m for (s, a), m in cells.items()})
    if strongest is not None:
        out["any"] = {"strongest": {**strongest[1], "cell": strongest[0]}}
    return out


def _fmt(entry: Mapping[str, Any], metric: str, digits: int = 3) -> str:
    s = entry[metric]
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def format_table(plans: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per plan x attack x view: median [min-max] of TPR@1%, TPR@0.1% (* = not
    meaningful), AUC; the plan's reference trainings and median seconds."""
    head = (f"{'plan':<12} {'attack':<18} {'view':<12} {'TPR@1%FPR':>21} {'TPR@0.1%FPR':>22} "
            f"{'AUC':>21} {'refs':>4} {'s':>6}")
    lines = [head, "-" * len(head)]
    for name, p in plans.items():
        plan = name.split(":", 1)[0]
        for attack, vs in p["attacks"].items():
            for view, e in vs.items():
                star = "" if e["tpr_at_01pct_meaningful"] else "*"
                lines.append(
                    f"{plan:<12} {attack:<18} {view:<12} {_fmt(e, 'tpr_at_1pct'):>21} "
                    f"{_fmt(e, 'tpr_at_01pct') + star:>22} {_fmt(e, 'auc'):>21} "
                    f"{p['reference_trainings']:>4} {p['seconds']['median']:>6.1f}")
    lines.extend(name for name in plans if ":" in name)
    lines.append("* TPR at 0.1% FPR not meaningful: fewer than 1000 non-members (0.1% of 300 "
                 "is below one example; the figure is the TPR above every non-member)")
    return "\n".join(lines)


# --- the measurement (torch) -----------------------------------------------------------------


def _load(seed: int) -> Any:
    from dpsweep.trainables.data.splits import SplitSizes, load_splits
    return load_splits(dataset="digits", seed=seed, sizes=SplitSizes(**SPLIT_SIZES))


def _collecting(trainer: Callable, classifiers: Iterable[tuple[Any, int]]) -> Callable:
    """``trainer`` with every shadow classifier fed the references below its count."""
    classifiers = list(classifiers)

    def train(data: Any, seed: int, index: int) -> tuple[Any, float]:
        model, seconds = trainer(data, seed, index)
        for clf, k in classifiers:
            if index < k:
                clf.wrap(lambda *_: (model, seconds))(data, seed, index)
        return model, seconds

    return train


def _plan_cells(signals: Any, classifier: Any, target: Any, *, n_references: int
                ) -> dict[tuple[str, str], dict[str, Any]]:
    """{(signal, attack): metrics} of every finite cell with the first ``n_references``."""
    from dpsweep.trainables.audit.references import score_signals
    labels = signals.plan.is_member
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for signal, attacks in score_signals(signals, n_references=n_references).items():
        for attack, result in attacks.items():
            if np.isfinite(result.scores).all():
                cells[(signal, attack)] = cell_metrics(result.scores, labels)
    shadow = classifier.scores(target)
    for layer, probs in shadow.scores.items():
        if np.isfinite(probs).all():
            cells[(f"ir:{layer}", SHADOW)] = cell_metrics(probs, labels)
    return cells


def run_seed(seed: int, *, epochs: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every plan row on one seed's target."""
    import torch

    from dpsweep.trainables.audit.classifier import ShadowClassifier
    from dpsweep.trainables.audit.probes import probe_set_of, probe_signals
    from dpsweep.trainables.audit.references import (
        NonPrivateRecipe,
        accuracy,
        collect_signals,
        nonprivate_trainer,
        plan_references,
        train_nonprivate,
    )

    torch.set_num_threads(1)
    data = _load(seed)
    recipe = NonPrivateRecipe(epochs=epochs, lr=LR, batch_size=BATCH)
    target, target_seconds = train_nonprivate(data=data, recipe=recipe,
                                              seed=TARGET_SEED + seed)
    result: dict[str, Any] = {
        "seed": seed, "target_seed": TARGET_SEED + seed, "audit_seed": seed,
        "target_train_seconds": target_seconds,
        "target_train_accuracy": accuracy(target, data.train),
        "target_test_accuracy": accuracy(target, data.test), "plans": {}}
    log(f"seed {seed}: target trained in {target_seconds:.1f} s, train accuracy "
        f"{result['target_train_accuracy']:.3f}, test {result['target_test_accuracy']:.3f}")
    base = nonprivate_trainer(recipe)
    for kind in dict.fromkeys(k for _, k, _, _ in PLAN_ROWS):
        rows = [(name, trained, used) for name, k, trained, used in PLAN_ROWS if k == kind]
        trained = max(t for _, t, _ in rows)
        plan = plan_references(data=data, kind=kind, n_references=trained, seed=seed)
        classifiers = {}
        for name, _, used in rows:
            sub = plan_references(data=data, kind=kind, n_references=used, seed=seed)
            if not (np.array_equal(sub.in_mask, plan.in_mask[:used])
                    and np.array_equal(sub.candidates.indices, plan.candidates.indices)):
                raise AssertionError(f"{name}: the first {used} references are not the plan's")
            classifiers[name] = (ShadowClassifier(sub, classes=data.num_classes, seed=seed),
                                 used)
        extra = probe_signals(probe_set=probe_set_of(data.validation, seed=seed),
                              num_classes=data.num_classes)
        stamps: list[float] = []
        start = time.perf_counter()
        signals = collect_signals(target=target, data=data, plan=plan,
                                  trainer=_collecting(base, classifiers.values()), extra=extra,
                                  progress=lambda _, s=stamps: s.append(time.perf_counter()))
        for name, _, used in rows:
            t0 = time.perf_counter()
            cells = _plan_cells(signals, classifiers[name][0], target, n_references=used)
            scoring = time.perf_counter() - t0
            seconds = stamps[used - 1] - start + scoring
            result["plans"][name] = {
                "kind": kind, "n_references": used, "reference_trainings": used,
                "reference_train_seconds": sum(r.train_seconds
                                               for r in signals.records[:used]),
                "scoring_seconds": scoring, "seconds": seconds,
                "reference_test_accuracy": [r.test_accuracy for r in signals.records[:used]],
                "cells": {f"{a}/{s}": m for (s, a), m in sorted(cells.items())},
                "views": views(cells)}
            v = result["plans"][name]["views"]["any"]["strongest"]
            log(f"seed {seed}: {name} {seconds:.1f} s, strongest {v['cell']} TPR@1% "
                f"{v['tpr_at_1pct']:.3f} AUC {v['auc']:.3f}")
        result.setdefault("signals", {})[kind] = signals
        if kind == "online":
            own = classifiers[next(n for n, _, used in rows if used == PER_TRIAL)][0]
            result["plans"][POOLED_ROW] = _pooled_plan(
                data=data, target=target, signals=signals, classifier=own, extra=extra,
                seed=seed, recipe=recipe, started=start, stamps=stamps)
            v = result["plans"][POOLED_ROW]["views"]["any"]["strongest"]
            log(f"seed {seed}: {POOLED_ROW}, strongest {v['cell']} TPR@1% "
                f"{v['tpr_at_1pct']:.3f} AUC {v['auc']:.3f}")
    return result


def _pooled_plan(*, data: Any, target: Any, signals: Any, classifier: Any, extra: Any,
                 seed: int, recipe: Any, started: float, stamps: list[float]
                 ) -> dict[str, Any]:
    """The pooled row: block 0's references are the first ``PER_TRIAL`` of the online plan
    (same halves and seeds: ``plan_references`` keys reference k of block b by pair
    b * K/2 + k // 2 and seed index b * K + k), blocks 1.. train with ``STUDY_RECIPES``; so the
    pooled plan differs from the 16-reference one only in the recipes (checked)."""
    import dataclasses

    from dpsweep.orchestrator.audit.pooling import pool_signals
    from dpsweep.trainables.audit.references import (
        collect_signals,
        nonprivate_trainer,
        plan_references,
    )
    own_plan = plan_references(data=data, kind="online", n_references=PER_TRIAL, seed=seed)
    k = PER_TRIAL
    own = dataclasses.replace(
        signals, plan=own_plan, references={n: v[:k] for n, v in signals.references.items()},
        population_references={n: v[:k] for n, v in signals.population_references.items()},
        records=signals.records[:k])
    others, trained = [], 0.0
    for block, (lr, epochs, batch) in enumerate(STUDY_RECIPES, start=1):
        plan = plan_references(data=data, kind="online", n_references=k, seed=seed,
                               block=block)
        rows = slice(block * k, (block + 1) * k)
        if not np.array_equal(plan.in_mask, signals.plan.in_mask[rows]):
            raise AssertionError(f"block {block}: its halves are not the online plan's")
        trial = dataclasses.replace(recipe, lr=lr or recipe.lr, epochs=epochs or recipe.epochs,
                                    batch_size=batch or recipe.batch_size)
        got = collect_signals(target=target, data=data, plan=plan,
                              trainer=nonprivate_trainer(trial), extra=extra)
        trained += sum(r.train_seconds for r in got.records)
        others.append(got)
    pooled = pool_signals(own, others)
    t0 = time.perf_counter()
    cells = _plan_cells(pooled, classifier, target, n_references=pooled.plan.n_references)
    scoring = time.perf_counter() - t0
    return {"kind": POOLED_KIND, "n_references": pooled.plan.n_references,
            "reference_trainings": k, "study_reference_train_seconds": trained,
            "reference_train_seconds": sum(r.train_seconds for r in own.records),
            "scoring_seconds": scoring, "seconds": stamps[k - 1] - started + scoring,
            "reference_test_accuracy": [r.test_accuracy for r in pooled.records],
            "cells": {f"{a}/{s}": m for (s, a), m in sorted(cells.items())},
            "views": views(cells)}


def dump_seed(run: Mapping[str, Any], *, directory: Path) -> Path:
    """``directory/seed<N>.npz``: per plan kind the candidates' membership, the references'
    ``in_mask``, every signal's target and reference values (``<kind>/is_member``,
    ``<kind>/in_mask``, ``<kind>/target/<signal>``, ``<kind>/references/<signal>``), and, as
    JSON under ``plans``, every plan row's kind, reference count and cells: what re-scoring an
    attack needs without the membership labels ever reaching the attack."""
    arrays: dict[str, np.ndarray] = {}
    for kind, signals in run["signals"].items():
        arrays[f"{kind}/is_member"] = np.asarray(signals.plan.is_member, dtype=bool)
        arrays[f"{kind}/in_mask"] = np.asarray(signals.plan.in_mask, dtype=bool)
        for name, values in signals.target.items():
            arrays[f"{kind}/target/{name}"] = np.asarray(values, dtype=np.float64)
            arrays[f"{kind}/references/{name}"] = np.asarray(signals.references[name],
                                                             dtype=np.float64)
    plans = {name: {"kind": p["kind"], "n_references": p["n_references"], "cells": p["cells"]}
             for name, p in run["plans"].items()}
    arrays["plans"] = np.asarray(json.dumps(plans))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"seed{run['seed']}.npz"
    np.savez_compressed(path, **arrays)
    return path


def summarise(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    plans: dict[str, Any] = {}
    for name in runs[0]["plans"]:
        per = [r["plans"][name] for r in runs]
        plans[name] = {
            "kind": per[0]["kind"], "n_references": per[0]["n_references"],
            "reference_trainings": per[0]["reference_trainings"],
            "seconds": spread([p["seconds"] for p in per]),
            "reference_train_seconds": spread([p["reference_train_seconds"] for p in per]),
            "attacks": aggregate([p["views"] for p in per])}
    return plans


def _code_state() -> dict[str, Any]:
    """The commit and a digest of the uncommitted changes to the audit's code (others edit it
    while benches run: this says which code was measured)."""
    import hashlib
    import subprocess
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    paths = ("trainables/audit", "orchestrator/audit")
    diff = git("diff", "HEAD", "--", *paths)
    return {"commit": git("rev-parse", "HEAD").strip(),
            "audit_diff_sha256": hashlib.sha256(diff.encode()).hexdigest(),
            "audit_files_changed": git("diff", "HEAD", "--name-only", "--", *paths).split(),
            "audit_files_untracked": git("ls-files", "--others", "--exclude-standard", "--",
                                         *paths).split()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--out", default="audit_strength")
    parser.add_argument("--dump", type=Path, default=None,
                        help="also save each seed's signals and cells here (npz per seed)")
    args = parser.parse_args(argv)

    from bench.harness import load_average, write_results

    code = _code_state()
    started = time.perf_counter()
    load_before = load_average()
    runs = []
    for seed in range(args.seeds):
        run = run_seed(seed, epochs=args.epochs, log=lambda line: print(line, flush=True))
        if args.dump is not None:
            dump_seed(run, directory=args.dump)
        run.pop("signals", None)
        runs.append(run)
    plans = summarise(runs)
    wall = time.perf_counter() - started
    print(format_table(plans))
    print(f"wall {wall:.0f} s over {args.seeds} seeds")
    payload = {
        "bench": "audit_strength", "issue": "41 item 4",
        "setup": {"dataset": "digits", "split_sizes": SPLIT_SIZES, "epochs": args.epochs,
                  "lr": LR, "batch_size": BATCH, "model": "auto (digits_cnn)",
                  "target_seed": f"{TARGET_SEED} + seed", "data_seed": "seed",
                  "audit_seed": "seed", "layer_probes": True, "threads": 1,
                  "fprs": list(FPRS)},
        "code": code, "seeds": list(range(args.seeds)), "plans": plans, "runs": runs,
        "wall_seconds": wall, "load_before": load_before, "load_after": load_average(),
        "python": platform.python_version()}
    write_results(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
