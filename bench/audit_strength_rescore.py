"""Re-score ``lira_pooled`` on the signals a ``bench.audit_strength --dump DIR`` run saved.

Training the references is what makes ``bench/audit_strength.py`` take minutes per seed; the
scoring takes milliseconds. A variant of :func:`~trainables.audit.scores.lira_pooled` (same
keyword signature: ``target``, ``references``, ``in_mask`` -> scores) is compared here on the
saved signals of every seed, with the bench's own metric: each online plan's strongest cell
(TPR at 1% FPR by the audit's rule, the maximum over every attack and signal the dump holds,
with the ``lira_pooled`` cells replaced by the variant's), its median and range over seeds, the
default plan's median against the 16-reference plan's (issue 41, item 4) and the median of the
per-seed ratios. The strongest cell is a maximum over cells chosen with the labels, so it is
noisy; the mean TPR of the variant's own cells on a signal family (``--family``, gradient norms
by default: the cells that win) moves less from seed to seed and shows smaller differences.

The variant sees only what the audit sees (the target's and the references' values and the
references' ``in_mask``); the membership labels are read only to measure it.

Run from the repository root, after ``.venv/bin/python -m bench.audit_strength --dump DIR``::

    .venv/bin/python -m bench.audit_strength_rescore DIR [--attack module:function]

What it measured for issue 41 item 4 (the committed setup, 10 seeds; strongest cell's median
TPR at 1% FPR, online-4 / online-16): the audit's ``lira_pooled`` 0.157 / 0.178 (0.879 of the
medians, median per-seed ratio 0.861), and no rescoring of the 4 references came within 90%.
Per-candidate variances shrunk toward the pooled one (prior weights 1-16, or estimated from the
references as limma does) 0.142-0.148; a variance smooth in difficulty 0.143; per-candidate
shifts shrunk toward their bin's 0.153; a hierarchical Gaussian fit (precision-weighted means,
IN and OUT variances, predictive variances) 0.152-0.155; Student-t residuals 0.153-0.155; 1 to
40 bins or a polynomial shift curve 0.145-0.158; each model's values normalised (offset, affine,
quantiles) before the fit 0.143-0.160, online-16 rising to 0.182 with it. A robust global
variance changes no ranking (one scale for every candidate). What 4 references leave is the
noise of each candidate's mean: with the 16 references' mean (an oracle) the 4 references'
shifts reach 0.162.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.audit_strength import PLAN_ROWS, best_cell, cell_metrics

#: The attack whose cells are replaced, and the variant used when none is named (the audit's).
POOLED = "lira_pooled"
DEFAULT_ATTACK = "dpsweep.trainables.audit.scores:lira_pooled"
#: The plan kind lira_pooled runs on (it needs IN references), and the two rows compared: the
#: bench's online rows with the fewest (the default) and the most references.
ONLINE = "online"
_ONLINE_ROWS = sorted((used, row) for row, kind, _, used in PLAN_ROWS if kind == ONLINE)
SHORT_ROW, FULL_ROW = _ONLINE_ROWS[0][1], _ONLINE_ROWS[-1][1]
#: Signals whose variant cells are averaged (the strongest cells are gradient norms).
DEFAULT_FAMILY = "grad_norm"

#: ``attack(target=[N], references=[K, N], in_mask=[K, N]) -> scores [N]``.
PooledAttack = Callable[..., np.ndarray]


@dataclass(frozen=True, eq=False)
class SeedDump:
    """One seed's online signals and every plan's cells, as
    :func:`bench.audit_strength.dump_seed` wrote them."""

    seed: int
    is_member: np.ndarray  # [N]
    in_mask: np.ndarray  # [K, N]
    target: dict[str, np.ndarray]  # signal -> [N]
    references: dict[str, np.ndarray]  # signal -> [K, N]
    plans: dict[str, dict[str, Any]]  # row -> {"kind", "n_references", "cells"}


def load_dump(path: Path) -> SeedDump:
    """The online part of one ``seed<N>.npz``."""
    with np.load(path) as z:
        target_prefix, refs_prefix = f"{ONLINE}/target/", f"{ONLINE}/references/"
        target = {k[len(target_prefix):]: z[k] for k in z.files if k.startswith(target_prefix)}
        references = {k[len(refs_prefix):]: z[k] for k in z.files if k.startswith(refs_prefix)}
        return SeedDump(seed=int(path.stem.removeprefix("seed")),
                        is_member=z[f"{ONLINE}/is_member"], in_mask=z[f"{ONLINE}/in_mask"],
                        target=target, references=references,
                        plans=json.loads(str(z["plans"])))


def load_dumps(directory: Path) -> list[SeedDump]:
    """Every ``seed<N>.npz`` of ``directory``, by seed."""
    dumps = [load_dump(p) for p in directory.glob("seed*.npz")]
    if not dumps:
        raise FileNotFoundError(f"no seed<N>.npz in {directory}")
    return sorted(dumps, key=lambda d: d.seed)


def rescore_seed(dump: SeedDump, attack: PooledAttack, *,
                 rows: Sequence[str] = (SHORT_ROW, FULL_ROW)) -> dict[str, dict[str, Any]]:
    """Per row: every ``lira_pooled`` cell re-scored by ``attack`` on the row's first
    references (``pooled``: {signal: metrics}), and the row's strongest cell over those and the
    dump's other cells (``strongest``: {"cell", "tpr_at_1pct", "auc"})."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        plan = dump.plans[row]
        if plan["kind"] != ONLINE:
            raise ValueError(f"{row} is a {plan['kind']} plan: {POOLED} runs on online ones")
        k = plan["n_references"]
        pooled: dict[str, dict[str, Any]] = {}
        for name, values in dump.target.items():
            scores = attack(target=values, references=dump.references[name][:k],
                            in_mask=dump.in_mask[:k])
            if np.isfinite(scores).all():
                pooled[name] = cell_metrics(scores, dump.is_member)
        cells = {c: m for c, m in plan["cells"].items() if not c.startswith(f"{POOLED}/")}
        cells.update({f"{POOLED}/{name}": m for name, m in pooled.items()})
        best = best_cell(cells)
        if best is None:
            raise ValueError(f"{row}: no cell to compare")
        out[row] = {"pooled": pooled, "strongest": {"cell": best[0],
                                                    "tpr_at_1pct": best[1]["tpr_at_1pct"],
                                                    "auc": best[1]["auc"]}}
    return out


def summarise(per_seed: Sequence[Mapping[str, Mapping[str, Any]]], *,
              family: str = DEFAULT_FAMILY) -> dict[str, Any]:
    """Median, min and max of each row's strongest TPR at 1% FPR over seeds, the mean TPR of the
    variant's cells on ``family`` signals, the ratio of the two rows' medians, and the median
    of the per-seed ratios."""
    rows: dict[str, Any] = {}
    for row in per_seed[0]:
        best = [s[row]["strongest"]["tpr_at_1pct"] for s in per_seed]
        own = [m["tpr_at_1pct"] for s in per_seed for name, m in s[row]["pooled"].items()
               if name.startswith(family)]
        rows[row] = {"median": statistics.median(best), "min": min(best), "max": max(best),
                     "values": best, "family_mean": float(np.mean(own)) if own else None}
    out: dict[str, Any] = {"rows": rows}
    if SHORT_ROW in rows and FULL_ROW in rows:
        short, full = rows[SHORT_ROW], rows[FULL_ROW]
        out["ratio_of_medians"] = short["median"] / full["median"]
        out["median_seed_ratio"] = statistics.median(
            a / b for a, b in zip(short["values"], full["values"], strict=True))
    return out


def resolve(spec: str) -> PooledAttack:
    """``module:function`` -> the function (the module imported by name)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"attack {spec!r} is not module:function")
    return getattr(importlib.import_module(module), name)


def format_summary(summary: Mapping[str, Any], *, family: str = DEFAULT_FAMILY) -> str:
    lines = []
    for row, r in summary["rows"].items():
        mean = "-" if r["family_mean"] is None else f"{r['family_mean']:.3f}"
        lines.append(f"{row:<20} strongest TPR@1%FPR {r['median']:.3f} [{r['min']:.3f}-"
                     f"{r['max']:.3f}]   {POOLED} mean on {family}: {mean}")
    if "ratio_of_medians" in summary:
        lines.append(f"{SHORT_ROW} / {FULL_ROW}: medians {summary['ratio_of_medians']:.3f}, "
                     f"median per-seed ratio {summary['median_seed_ratio']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("dump", type=Path, help="the directory bench.audit_strength --dump wrote")
    parser.add_argument("--attack", default=DEFAULT_ATTACK, help="module:function")
    parser.add_argument("--family", default=DEFAULT_FAMILY)
    args = parser.parse_args(argv)
    attack = resolve(args.attack)
    per_seed = [rescore_seed(d, attack) for d in load_dumps(args.dump)]
    print(format_summary(summarise(per_seed, family=args.family), family=args.family))
    return 0


if __name__ == "__main__":
    sys.exit(main())
