"""Calibrated per-layer membership attacks (LiRA / RMIA) on a deliberately leaky model.

A non-private cnn28 (digits_cnn with ``--dataset digits``) is overfit on ``--members`` examples;
non-members come from the holdout split, reference models from ``trainables.audit.references``
(online: halves of members + non-members; offline: subsets of the public shadow pool). Prints
and writes (``bench/results/audit_<dataset>.json``, ROC plot ``audit_<dataset>_roc.png``):

1. the attack table per plan: signal x attack, accuracy at the attack's natural threshold
   (no target labels used), AUC, TPR at 1% and 0.1% FPR, and the uncalibrated loss-threshold
   baseline on the same candidates;
2. the signal choice: per layer, the chosen log gradient norm against the raw gradient norm
   (Gaussianity: median |skewness| across OUT references per candidate, and the attack it
   gives) and two alternatives (the loss of a linear probe fitted on the layer's representation
   of held-out data; the log norm of the layer's activation);
3. the cost: reference training vs signal and scoring seconds, and the best per-layer TPR at 1%
   FPR, for 4, 8 and 16 references;
4. the acceptance check: best per-layer accuracy >= the loss baseline, its TPR at 1% FPR >=
   0.05, and leakage (AUC of the best attack per layer) growing with depth.

Run from the repository root: ``.venv/bin/python -m bench.audit_fmnist [--quick]
[--dataset digits] [--plans online|offline] [--cache DIR]``. One torch thread (the machine is
shared). Fashion-MNIST defaults train 33 cnn28s (target + 16 online + 16 offline references) of
~22 s each on a quiet core, plus signals (~6 s per model) and the alternatives' probes (first 8
references): ~20 minutes; under a load of 8 on 2 shared cores each plan took 44 minutes, so the
plans can run as two processes (``--plans online`` / ``--plans offline`` with one ``--cache``
directory) and a last run with the same cache combines them, retraining only the target.
``--quick`` (500 members, 20 epochs, 4 references per plan): ~4 minutes quiet, 17 under load.
Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` (``make data``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import expit
from scipy.stats import skew
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score, roc_curve
from sklearn.preprocessing import StandardScaler

from dpsweep.core.storage import atomic_write_json
from dpsweep.trainables.audit.layer_attack import reduce_ir
from dpsweep.trainables.audit.references import (
    PLANS,
    AuditSignals,
    NonPrivateRecipe,
    accuracy,
    collect_signals,
    nonprivate_trainer,
    plan_references,
    score_signals,
    train_nonprivate,
)
from dpsweep.trainables.audit.scores import (
    LIRA_OFFLINE,
    LIRA_ONLINE,
    LOSS_THRESHOLD,
    RMIA,
    AttackScores,
    SignalObservations,
    attack_signal,
    rmia_log_ratio,
    rmia_score,
)
from dpsweep.trainables.audit.signals import GRAD_NORM, LOSS, grad_norm_name
from dpsweep.trainables.data.splits import DataSplits, Split, SplitSizes, load_splits
from dpsweep.trainables.models.networks import LayeredModel

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LOW_FPRS = (0.01, 0.001)
#: Reference counts whose cost and power are compared (first K of the trained references).
REFERENCE_COUNTS = (4, 8, 16)
#: Acceptance: the best per-layer attack's TPR at 1% FPR must reach this.
MIN_TPR_AT_1PCT = 0.05
#: Examples (from the test split, seen by no model) a layer's linear probe is fitted on.
PROBE_EXAMPLES = 1000
PROBE_C = 1.0
PROBE_MAX_ITER = 300
ALT_PROBE = "probe_loss"
ALT_ACT = "act_norm"
#: log ||p - e_y||: the norm of the loss gradient w.r.t. the logits (the output residual every
#: layer's gradient is a linear image of).
OUT_GRAD = "out_grad_norm"
#: References that also get the alternative signals (probes cost a fit per model and layer).
ALT_REFERENCES = 8
#: Fewest OUT values per candidate for a sample skewness.
MIN_SKEW_VALUES = 3

#: Digits overfits within 100 epochs (train loss ~3e-3), quick or not: its models are cheap.
DIGITS_EPOCHS = 100
SIZES = {  # (members, validation, test, shadow pool) per dataset; holdout = members
    "fashion-mnist": (1000, 500, 2000, 2000),
    "digits": (300, 100, 297, 800),
}


def tpr_at(labels: np.ndarray, scores: np.ndarray, max_fpr: float) -> float:
    fpr, tpr, _ = roc_curve(labels, scores)
    return float(tpr[fpr <= max_fpr].max())


def metrics(labels: np.ndarray, a: AttackScores) -> dict[str, float]:
    return {"accuracy": float((a.decisions() == labels).mean()),
            "auc": float(roc_auc_score(labels, a.scores)),
            "tpr_1pct": tpr_at(labels, a.scores, LOW_FPRS[0]),
            "tpr_01pct": tpr_at(labels, a.scores, LOW_FPRS[1]),
            "threshold": a.threshold, **{k: v for k, v in a.params.items() if v is not None}}


# --- alternative per-layer signals (kept here only: the product uses gradient norms) ---------


def alternative_signals(probe_set: Split, seconds: list[float]
                        ) -> Callable[[LayeredModel, torch.Tensor, torch.Tensor],
                                      dict[str, np.ndarray]]:
    """Per layer: the cross-entropy of a multinomial logistic probe fitted (per model) on the
    layer's representation of ``probe_set``, and the log L2 norm of the layer's activation.
    Both are invariant to permuting the layer's units (the L2-regularised probe is
    permutation-equivariant). Also log ||p - e_y|| (``OUT_GRAD``), to split each layer's
    gradient norm into the shared output residual and the layer's own factor. Appends its
    seconds to ``seconds`` (so the product's signal time can be told apart)."""
    def extra(model: LayeredModel, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        if len(seconds) > ALT_REFERENCES:  # the target, then the first ALT_REFERENCES
            names = [f"{kind}:{n}" for n in model.layer_names for kind in (ALT_ACT, ALT_PROBE)]
            seconds.append(0.0)
            return {n: np.full(len(y), np.nan) for n in [*names, OUT_GRAD]}
        model.eval()
        with torch.no_grad():
            _, fit_irs = model.forward_with_irs(probe_set.x)
            _, irs = model.forward_with_irs(x)
        out: dict[str, np.ndarray] = {}
        for name in model.layer_names:
            ir = irs[name]
            out[f"{ALT_ACT}:{name}"] = np.log(ir.flatten(1).norm(dim=1).double().numpy())
            scaler = StandardScaler().fit(reduce_ir(fit_irs[name]).numpy())
            probe = LogisticRegression(C=PROBE_C, max_iter=PROBE_MAX_ITER)
            probe.fit(scaler.transform(reduce_ir(fit_irs[name]).numpy()), probe_set.y.numpy())
            logp = probe.predict_log_proba(scaler.transform(reduce_ir(ir).numpy()))
            out[f"{ALT_PROBE}:{name}"] = -logp[np.arange(len(y)), y.numpy()]
        with torch.no_grad():
            logits = copy.deepcopy(model).double()(x.double())
        residual = logits.softmax(dim=1) - F.one_hot(y, logits.shape[1]).double()
        out[OUT_GRAD] = np.log(np.maximum(residual.norm(dim=1).numpy(), 1e-300))
        seconds.append(time.perf_counter() - t0)
        return out

    return extra


def gaussianity(sig: AuditSignals, name: str, *, raw: bool) -> float:
    """Median over candidates of |skewness| of the signal across the OUT references."""
    values = sig.references[name]
    values = np.exp(values) if raw else values
    mask = ~sig.plan.in_mask
    per = [abs(skew(values[mask[:, n], n])) for n in range(values.shape[1])
           if mask[:, n].sum() >= MIN_SKEW_VALUES]
    return float(np.median(per)) if per else float("nan")


# --- the bench -------------------------------------------------------------------------------


def load(dataset: str, members: int) -> DataSplits:
    _, validation, test, pool = SIZES[dataset]
    sizes = SplitSizes(train=members, validation=validation, holdout=members, test=test,
                       shadow=max(pool, 2 * members) if dataset != "digits" else pool)
    return load_splits(dataset=dataset, seed=0, sizes=sizes)


def layer_table(sig: AuditSignals, labels: np.ndarray, *, k: int) -> dict[str, dict[str, Any]]:
    scored = score_signals(sig, names=[n for n in sig.target if not n.startswith(
        (ALT_PROBE, ALT_ACT, OUT_GRAD))], n_references=k)
    return {f"{name}/{attack}": metrics(labels, a)
            for name, attacks in scored.items() for attack, a in attacks.items()}


def print_table(title: str, table: dict[str, dict[str, Any]]) -> None:
    print(f"\n== {title}")
    print(f"   {'signal/attack':34s} {'acc':>6s} {'AUC':>6s} {'TPR@1%':>7s} {'TPR@.1%':>8s}")
    for key, m in table.items():
        print(f"   {key:34s} {m['accuracy']:6.3f} {m['auc']:6.3f} {m['tpr_1pct']:7.3f} "
              f"{m['tpr_01pct']:8.3f}")


def best_per_layer(table: dict[str, dict[str, Any]], layers: list[str],
                   attacks: tuple[str, ...]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Per layer, the attack on its gradient norm with the best TPR at 1% FPR (AUC on ties)."""
    out = {}
    for layer in layers:
        cands = [(a, table[f"{grad_norm_name(layer)}/{a}"]) for a in attacks
                 if f"{grad_norm_name(layer)}/{a}" in table]
        out[layer] = max(cands, key=lambda c: (c[1]["tpr_1pct"], c[1]["auc"]))
    return out


def derived(sig: AuditSignals, name: str, fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
            *, direction: int, probability: Callable[[np.ndarray], np.ndarray],
            other: str = OUT_GRAD) -> SignalObservations:
    """Observations of fn(signal ``name``, signal ``other``) for target and references."""
    return SignalObservations(
        name=name, direction=direction, probability=probability,
        target=fn(sig.target[name], sig.target[other]),
        references=fn(sig.references[name], sig.references[other]), in_mask=sig.plan.in_mask,
        population_references=fn(sig.population_references[name],
                                 sig.population_references[other]),
        population_in_mask=sig.plan.population_in_mask)


#: The per-layer signals compared, in print order.
CHOICES = ("log_grad_norm", "raw_grad_norm", "layer_factor", "probe_loss", "act_norm")


def reference_direction(obs: SignalObservations) -> int:
    """+1 when the references' IN values exceed their OUT values on average (their own
    membership, not the target's): the direction of a signal not known in advance."""
    values, mask = obs.calibration()
    return 1 if np.nanmean(values[mask]) > np.nanmean(values[~mask]) else -1


def signal_choice(sig: AuditSignals, labels: np.ndarray, layers: list[str]) -> dict[str, Any]:
    """Chosen signal (log grad norm) vs the raw grad norm, the layer's own factor of it (log
    grad norm - log ||p - e_y||), the probe loss and the activation norm, per layer, all with
    the first ``ALT_REFERENCES`` references (those that have the alternatives)."""
    k = min(ALT_REFERENCES, sig.plan.n_references)
    out: dict[str, Any] = {}
    for layer in layers:
        gname = grad_norm_name(layer)
        row: dict[str, Any] = {"skew_log": gaussianity(sig, gname, raw=False),
                               "skew_raw": gaussianity(sig, gname, raw=True)}
        variants = {
            "log_grad_norm": sig.observations(gname),
            "raw_grad_norm": derived(sig, gname, lambda g, _: np.exp(g), direction=-1,
                                     probability=lambda v: 1 / (1 + v)),
            "layer_factor": derived(sig, gname, lambda g, o: g - o, direction=-1,
                                    probability=lambda v: expit(-v)),
            "probe_loss": sig.observations(f"{ALT_PROBE}:{layer}", direction=-1,
                                           probability=lambda v: np.exp(-v)),
            "act_norm": sig.observations(f"{ALT_ACT}:{layer}", direction=1,
                                         probability=expit),
        }
        for label, obs in variants.items():
            obs = obs.head(k)
            if label in ("layer_factor", "act_norm"):
                d = reference_direction(obs)
                obs = dataclasses.replace(obs, direction=d,
                                          probability=lambda v, d=d: expit(d * v))
            row[label] = {a: metrics(labels, s) for a, s in attack_signal(obs).items()}
            row[label]["direction"] = obs.direction
        out[layer] = row
    return out


def run_plan(kind: str, *, data: DataSplits, target: LayeredModel, recipe: NonPrivateRecipe,
             args: argparse.Namespace, probe_set: Split) -> dict[str, Any]:
    plan = plan_references(data=data, kind=kind, n_references=args.references, seed=args.seed,
                           population_size=args.population)
    print(f"\n-- {kind}: {plan.n_references} references of {plan.reference_size} examples; "
          f"{len(plan.candidates)} candidates, {len(plan.population)} population samples"
          + (f"; {plan.note}" if plan.note else ""), flush=True)

    def progress(r: Any) -> None:
        print(f"   reference {r.index}: train {r.train_seconds:.1f} s, signals "
              f"{r.signal_seconds:.1f} s, test acc {r.test_accuracy:.3f}", flush=True)

    extra_seconds: list[float] = []  # the target's, then each reference's
    cache = (None if args.cache is None else Path(args.cache) /
             f"{data.name}-{kind}-{args.members}-{args.epochs}-{args.references}-{args.seed}.pkl")
    if cache is not None and cache.is_file():
        sig, extra_seconds = pickle.loads(cache.read_bytes())
        print(f"   signals from {cache}")
    else:
        sig = collect_signals(target=target, data=data, plan=plan,
                              trainer=nonprivate_trainer(recipe, threads=1),
                              extra=alternative_signals(probe_set, extra_seconds),
                              progress=progress)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_bytes(pickle.dumps((sig, extra_seconds)))
    labels = plan.is_member
    layers = target.layer_names
    attacks = (LIRA_ONLINE, LIRA_OFFLINE, RMIA) if kind == "online" else (LIRA_OFFLINE, RMIA)
    full = layer_table(sig, labels, k=plan.n_references)
    print_table(f"{kind}, {plan.n_references} references", full)

    # RMIA's pairwise score against population samples z ranks like its log ratio.
    obs = sig.observations("logit")
    p = obs.probability
    lr_x = rmia_log_ratio(target=p(obs.target), references=p(obs.references),
                          in_mask=obs.in_mask, a=full["logit/rmia"].get("a", 1.0))
    lr_z = rmia_log_ratio(target=p(sig.population_target["logit"]),
                          references=p(sig.population_references["logit"]),
                          in_mask=sig.plan.population_in_mask,
                          a=full["logit/rmia"].get("a", 1.0))
    z_auc = float(roc_auc_score(labels, rmia_score(log_ratio=lr_x, population_log_ratio=lr_z)))

    costs = []
    for k in (c for c in REFERENCE_COUNTS if c <= plan.n_references):
        t0 = time.perf_counter()
        table = layer_table(sig, labels, k=k)
        scoring = time.perf_counter() - t0
        per_attack = {}
        for attack in attacks:
            rows = [table[f"{grad_norm_name(n)}/{attack}"] for n in layers]
            per_attack[attack] = {
                "mean_auc": float(np.mean([r["auc"] for r in rows])),
                "mean_tpr_1pct": float(np.mean([r["tpr_1pct"] for r in rows])),
                "max_tpr_1pct": max(r["tpr_1pct"] for r in rows),
                "max_accuracy": max(r["accuracy"] for r in rows),
                "per_layer_tpr_1pct": {n: r["tpr_1pct"] for n, r in zip(layers, rows,
                                                                         strict=True)}}
        costs.append({
            "references": k,
            "train_seconds": sum(r.train_seconds for r in sig.records[:k]),
            "signal_seconds": sig.target_signal_seconds
            + sum(r.signal_seconds for r in sig.records[:k]) - sum(extra_seconds[:k + 1]),
            "scoring_seconds": scoring, "attacks": per_attack})
    print(f"\n== {kind}: cost vs power over the {len(layers)} layers' gradient norms (signals: the "
          f"product's, on candidates + population, target included; scoring: every signal x "
          f"attack, numpy); target training {args.target_seconds:.1f} s")
    print(f"   {'K':>3s} {'train s':>8s} {'signals s':>9s} {'score s':>8s}  {'attack':13s} "
          f"{'mean AUC':>8s} {'mean TPR@1%':>11s} {'max TPR@1%':>10s} {'max acc':>7s}")
    for c in costs:
        for i, (attack, m) in enumerate(c["attacks"].items()):
            head = (f"{c['references']:3d} {c['train_seconds']:8.1f} {c['signal_seconds']:9.1f} "
                    f"{c['scoring_seconds']:8.2f}" if i == 0 else " " * 31)
            print(f"   {head}  {attack:13s} {m['mean_auc']:8.3f} {m['mean_tpr_1pct']:11.3f} "
                  f"{m['max_tpr_1pct']:10.3f} {m['max_accuracy']:7.3f}")

    choice = signal_choice(sig, labels, layers)
    shown = (LIRA_ONLINE, RMIA) if kind == "online" else (LIRA_OFFLINE, RMIA)
    print(f"\n== {kind}: per-layer signal choice ({min(ALT_REFERENCES, plan.n_references)} "
          f"references), AUC / TPR@1% of {' and '.join(shown)} (sign: member direction); skew = "
          f"median |skewness| of the grad norm across a candidate's OUT references")
    print(f"   {'layer':6s} {'skew log':>8s} {'raw':>5s}  " + "".join(f"{c:>28s}" for c in CHOICES))
    for layer, row in choice.items():
        cells = ["  ".join(f"{row[c][a]['auc']:.3f}/{row[c][a]['tpr_1pct']:.3f}" for a in shown)
                 for c in CHOICES]
        cells = [("-" if row[c]["direction"] < 0 else "+") + cell
                 for c, cell in zip(CHOICES, cells, strict=True)]
        print(f"   {layer:6s} {row['skew_log']:8.2f} {row['skew_raw']:5.2f}  "
              + "".join(f"{cell:>28s}" for cell in cells))
    return {"plan": {"kind": kind, "references": plan.n_references,
                     "reference_size": plan.reference_size, "note": plan.note,
                     "candidates": len(plan.candidates), "population": len(plan.population)},
            "table": full, "rmia_pairwise_auc_logit": z_auc, "costs": costs,
            "signal_choice": choice,
            "reference_test_accuracy": [r.test_accuracy for r in sig.records],
            "roc": roc_of_best(sig, labels, layers, attacks, full)}


def roc_of_best(sig: AuditSignals, labels: np.ndarray, layers: list[str],
                attacks: tuple[str, ...], table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    best = best_per_layer(table, layers, attacks)
    layer, (attack, _) = max(best.items(), key=lambda kv: kv[1][1]["tpr_1pct"])
    scored = score_signals(sig, names=[grad_norm_name(layer), LOSS])
    curves = {}
    for key, a in ((f"{grad_norm_name(layer)}/{attack}", scored[grad_norm_name(layer)][attack]),
                   (f"loss/{LOSS_THRESHOLD}", scored[LOSS][LOSS_THRESHOLD])):
        fpr, tpr, _ = roc_curve(labels, a.scores)
        curves[key] = {"fpr": fpr.tolist(), "tpr": tpr.tolist()}
    return curves


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for kind, res in results["plans"].items():
        for key, c in res["roc"].items():
            if key.startswith(LOSS) and kind != next(iter(results["plans"])):
                continue
            label = key if key.startswith(LOSS) else f"{kind}: {key}"
            ax.plot(np.maximum(c["fpr"], 1e-4), np.maximum(c["tpr"], 1e-4), label=label)
    ax.plot([1e-4, 1], [1e-4, 1], "k:", lw=0.8, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-3, 1)
    ax.set_ylim(1e-3, 1)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title(f"{results['dataset']}: best per-layer attack vs loss threshold")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def acceptance(results: dict[str, Any], layers: list[str]) -> dict[str, Any]:
    """The strongest per-layer attack (best accuracy at its own threshold over layers x
    attacks) vs the loss baseline, its TPR@1% >= 0.05, and AUC (best attack per layer)
    growing with depth."""
    out = {}
    for kind, res in results["plans"].items():
        table = res["table"]
        per_layer = {key: m for key, m in table.items() if key.startswith(GRAD_NORM)}
        best_key, best = max(per_layer.items(), key=lambda kv: kv[1]["accuracy"])
        loss = table[f"loss/{LOSS_THRESHOLD}"]
        aucs = [max(m["auc"] for key, m in per_layer.items()
                    if key.startswith(grad_norm_name(n) + "/")) for n in layers]
        out[kind] = {
            "best": best_key, "best_accuracy": best["accuracy"],
            "best_tpr_1pct": best["tpr_1pct"], "loss_accuracy": loss["accuracy"],
            "per_layer_auc": dict(zip(layers, aucs, strict=True)),
            "accuracy_ok": best["accuracy"] >= loss["accuracy"],
            "tpr_ok": best["tpr_1pct"] >= MIN_TPR_AT_1PCT,
            "depth_ok": all(b >= a for a, b in itertools.pairwise(aucs))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", choices=tuple(SIZES), default="fashion-mnist")
    ap.add_argument("--quick", action="store_true", help="4 references, fewer epochs")
    ap.add_argument("--members", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--references", type=int, default=None)
    ap.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    ap.add_argument("--population", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=None,
                    help="directory keeping each plan's signals (a rerun skips training)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    fmnist = args.dataset == "fashion-mnist"
    if args.members is None:
        args.members = (500 if args.quick else 1000) if fmnist else SIZES["digits"][0]
    if args.epochs is None:
        args.epochs = (20 if args.quick else 30) if fmnist else DIGITS_EPOCHS
    if args.references is None:
        args.references = 4 if args.quick else max(REFERENCE_COUNTS)
    data = load(args.dataset, args.members)
    recipe = NonPrivateRecipe(epochs=args.epochs, lr=3e-3, batch_size=32)
    target, seconds = train_nonprivate(data=data, recipe=recipe, seed=10_000 + args.seed)
    args.target_seconds = seconds
    test_acc = accuracy(target, data.test)
    probe_set = Split(x=data.test.x[:PROBE_EXAMPLES], y=data.test.y[:PROBE_EXAMPLES],
                      indices=data.test.indices[:PROBE_EXAMPLES])
    with torch.no_grad():
        train_loss = float(F.cross_entropy(target(data.train.x), data.train.y))
    print(f"target: {data.name}, {len(data.train)} members, recipe {recipe}; trained in "
          f"{seconds:.1f} s; train loss {train_loss:.2e}, train acc "
          f"{accuracy(target, data.train):.3f}, test acc {test_acc:.3f}", flush=True)
    results: dict[str, Any] = {
        "dataset": data.name, "members": len(data.train), "recipe": vars(recipe),
        "target_train_seconds": seconds, "target_test_accuracy": test_acc, "plans": {}}
    for kind in args.plans:
        results["plans"][kind] = run_plan(kind, data=data, target=target, recipe=recipe,
                                          args=args, probe_set=probe_set)
    layers = target.layer_names
    results["acceptance"] = acceptance(results, layers)
    print("\n== acceptance (best per-layer attack vs the loss-threshold baseline)")
    for kind, a in results["acceptance"].items():
        print(f"   {kind}: best {a['best']} acc {a['best_accuracy']:.3f} vs loss "
              f"{a['loss_accuracy']:.3f} [{'ok' if a['accuracy_ok'] else 'FAIL'}]; best TPR@1% "
              f"{a['best_tpr_1pct']:.3f} [{'ok' if a['tpr_ok'] else 'FAIL'}]; AUC by depth "
              + " ".join(f"{k}={v:.3f}" for k, v in a["per_layer_auc"].items())
              + f" [{'ok' if a['depth_ok'] else 'not monotone'}]")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = (f"audit_{data.name}" + ("_quick" if args.quick else "")
            + ("" if set(args.plans) == set(PLANS) else "_" + "_".join(args.plans)))
    png = RESULTS_DIR / f"{stem}_roc.png"
    plot(results, png)
    results["seconds"] = time.perf_counter() - start
    atomic_write_json(RESULTS_DIR / f"{stem}.json", results)
    print(f"\nwrote {RESULTS_DIR / (stem + '.json')} and {png}; total {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
