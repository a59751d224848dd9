"""Re-analyse one trial's membership audit from its stored per-candidate scores.

    python docs/reanalyse_audit.py RUN_DIR TRIAL_ID [--csv OUT.csv]

Reads ``RUN_DIR/trials/TRIAL_ID/audit.json`` and its ``audit_scores.npz`` (every audited
candidate's pool index, membership label and float32 score per layer x attack: the exact values
the audit's statistics were computed from), checks the scores file against the SHA-256 that
audit.json and the run's manifest record, and recomputes for every layer and attack, with numpy
and pandas only, independently of dpsweep's statistics code:

* the AUC: the Mann-Whitney U of members over non-members divided by n1 n0 (ties count half);
* the TPR at 1% FPR: the threshold is the (k+1)-th largest non-member score, k the most false
  positives that 1% of the non-members allows, and a member counts when its score is strictly
  above it;
* the balanced accuracy at the recorded decision threshold (member iff score > threshold).

It prints one row per layer x attack with the recorded and recomputed values and exits 1 when
any differs by more than 1e-9 (2 when the files are missing or do not match their hashes).
File names come from ``core.layout`` (the repository's, found from this file's location).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dpsweep.core import layout  # the file names only: nothing of dpsweep computes here

#: Largest |recorded - recomputed| accepted.
TOLERANCE = 1e-9
#: The false-positive rate the recorded TPR is read at.
FPR = 0.01


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(run_dir: Path, trial_id: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(audit.json, the scores file's arrays), the scores checked against both hashes."""
    trial = Path(run_dir) / layout.TRIALS / trial_id
    record = json.loads((trial / layout.AUDIT).read_text(encoding="utf-8"))
    path = trial / layout.AUDIT_SCORES
    digest = _sha256(path)
    if record.get("scores_sha256") not in (None, digest):
        raise ValueError(f"{path} differs from the SHA-256 its audit.json records")
    manifest = Path(run_dir) / layout.MANIFEST
    if manifest.is_file():
        entry = json.loads(manifest.read_text()).get("files", {}).get(
            f"{layout.TRIALS}/{trial_id}/{layout.AUDIT_SCORES}")
        if entry is not None and entry.get("sha256") not in (None, digest):
            raise ValueError(f"{path} differs from the SHA-256 the run's manifest records")
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return record, arrays


def auc(members: np.ndarray, nonmembers: np.ndarray) -> float:
    """Mann-Whitney U / (n1 n0), ties counted half (average ranks)."""
    ranks = pd.Series(np.concatenate([members, nonmembers])).rank(method="average").to_numpy()
    n1, n0 = len(members), len(nonmembers)
    return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def tpr_at_fpr(members: np.ndarray, nonmembers: np.ndarray, fpr: float = FPR) -> float:
    """TPR with at most ``fpr`` of the non-members strictly above the threshold."""
    n0 = len(nonmembers)
    k = math.floor(fpr * n0)
    while k + 1 <= n0 and (k + 1) / n0 <= fpr:
        k += 1
    while k > 0 and k / n0 > fpr:
        k -= 1
    threshold = np.sort(nonmembers)[::-1][k]
    return float(np.count_nonzero(members > threshold) / len(members))


def balanced_accuracy(members: np.ndarray, nonmembers: np.ndarray, threshold: float) -> float:
    return float((np.count_nonzero(members > threshold) / len(members)
                  + np.count_nonzero(nonmembers <= threshold) / len(nonmembers)) / 2)


def reanalyse(run_dir: Path, trial_id: str) -> pd.DataFrame:
    """One row per recorded layer x attack: recorded and recomputed AUC, TPR at 1% FPR and
    accuracy, and the largest absolute difference."""
    record, arrays = load(run_dir, trial_id)
    member = arrays["is_member"].astype(bool)
    rows_of = {(str(layer), str(attack)): i for i, (layer, attack)
               in enumerate(zip(arrays["layer"], arrays["attack"], strict=True))}
    rows = []
    for entry in record["attacks"]:
        scores = arrays["scores"][rows_of[(entry["layer"], entry["attack"])]].astype(np.float64)
        m, n = scores[member], scores[~member]
        row = {"layer": entry["layer"], "attack": entry["attack"],
               "auc": entry["auc"], "auc_recomputed": auc(m, n),
               "tpr_at_1pct_fpr": entry["tpr_at_1pct_fpr"],
               "tpr_at_1pct_fpr_recomputed": tpr_at_fpr(m, n)}
        if entry.get("threshold") is not None:
            row["accuracy"] = entry["accuracy"]
            row["accuracy_recomputed"] = balanced_accuracy(m, n, float(entry["threshold"]))
        row["max_abs_difference"] = max(abs(row[k] - row[f"{k}_recomputed"])
                                        for k in ("auc", "tpr_at_1pct_fpr", "accuracy")
                                        if k in row)
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("trial_id")
    parser.add_argument("--csv", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    try:
        table = reanalyse(args.run_dir, args.trial_id)
    except (OSError, ValueError, KeyError) as exc:
        print(f"cannot re-analyse {args.trial_id}: {exc}", file=sys.stderr)
        return 2
    if args.csv is not None:
        table.to_csv(args.csv, index=False)
    with pd.option_context("display.max_rows", None, "display.width", 160):
        print(table.to_string(index=False))
    worst = float(table["max_abs_difference"].max())
    print(f"{len(table)} layer x attack entries; largest difference {worst:.3g} "
          f"({'reproduced' if worst <= TOLERANCE else 'NOT reproduced'} to {TOLERANCE:g})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
