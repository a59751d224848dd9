"""``dpsweep pick RUN_DIR``: the deployable trial under the user's constraints.

Among the trials on the Pareto front (over all methods, or one method) whose epsilon claim
holds, keep those meeting ``--max-peak-mia`` / ``--min-test-acc`` and take the highest test
accuracy (ties: lower peak MIA, then trial id). The front is that of the trials pick may
release (valid DP unless ``--allow-invalid-dp``), so an invalid trial never knocks a valid one
off it; and since a trial dominating the best qualifying one would qualify too, restricting to
the front loses nothing. ``pick.toml`` records the choice, a config that reproduces it
(validated by :func:`orchestrator.config.from_dict`), the checkpoint and the privacy record.
When nothing qualifies, one UserInputError says which constraint excluded what and lists the
closest front trials.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import tomli_w

from core.errors import UserInputError
from orchestrator.config import Config, from_dict
from reports.html import INVALID_TAG, RunData, load_run, trial_dirs
from reports.pareto import ACC, MIA, eligible, front_of, natural_key

PICK_FILE = "pick.toml"
#: The [config] table alone, ready for ``dpsweep train PICK_CONFIG --out DIR``.
PICK_CONFIG_FILE = "pick_config.toml"
CLOSEST = 3
#: Method parameters a method's once-per-sweep preparation fills (LM-DP-SGD's risk vector and
#: its provenance): not hyperparameters; a rerun recomputes them (cached) from public data.
PREPARED_PARAMS = ("risk", "risk_meta")
#: Scalar fields of the privacy record copied into pick.toml's [privacy] table.
PRIVACY_FIELDS = ("mechanism", "method", "dp_valid", "validity_reason", "sample_rate", "steps",
                  "noise_multiplier", "clip_norm", "delta", "target_epsilon", "epsilon_lower",
                  "epsilon_estimate", "epsilon_upper", "accountant", "accountant_fallback",
                  "eps_error")


@dataclass(frozen=True)
class PickResult:
    """The chosen trial and everything written about it."""

    trial_id: str
    method: str
    mode: str
    test_accuracy: float
    peak_mia_accuracy: float
    peak_layer: str
    dp_valid: bool
    validity_reason: str
    checkpoint: Path
    config: Config
    privacy: dict[str, Any]
    constraints: dict[str, Any]
    qualifying: tuple[str, ...]  # front trials meeting every constraint, best first
    path: Path


def _check_constraints(*, max_peak_mia: float | None, min_test_acc: float | None) -> None:
    for flag, value in (("--max-peak-mia", max_peak_mia), ("--min-test-acc", min_test_acc)):
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise UserInputError(field=flag, value=value, allowed="an accuracy in [0, 1]")


def _meets(frame: pd.DataFrame, *, max_peak_mia: float | None,
           min_test_acc: float | None) -> pd.Series:
    ok = pd.Series(True, index=frame.index)
    if max_peak_mia is not None:
        ok &= frame[MIA] <= max_peak_mia
    if min_test_acc is not None:
        ok &= frame[ACC] >= min_test_acc
    return ok


def _ranked(frame: pd.DataFrame) -> pd.DataFrame:
    """Highest test accuracy first; ties: lower peak MIA, then trial id (as people read)."""
    keys = frame["trial_id"].map(natural_key)
    return frame.assign(_key=keys).sort_values(
        [ACC, MIA, "_key"], ascending=[False, True, True], kind="stable").drop(columns="_key")


def _describe(row: pd.Series) -> str:
    validity = "valid DP" if bool(row["dp_valid"]) else INVALID_TAG
    return (f"{row['trial_id']} ({row['method']}) test acc {row[ACC]:.4f}, "
            f"peak MIA {row[MIA]:.4f}, {validity}")


def _closest(front: pd.DataFrame, *, max_peak_mia: float | None,
             min_test_acc: float | None) -> list[str]:
    """The front trials nearest to meeting the constraints (sum of the shortfalls)."""
    if front.empty:
        return []
    short = pd.Series(0.0, index=front.index)
    if max_peak_mia is not None:
        short += (front[MIA] - max_peak_mia).clip(lower=0.0)
    if min_test_acc is not None:
        short += (min_test_acc - front[ACC]).clip(lower=0.0)
    ranked = _ranked(front).assign(_short=short).sort_values("_short", kind="stable")
    return [_describe(r) for _, r in ranked.head(CLOSEST).iterrows()]


def _nothing_qualifies(*, pool: pd.DataFrame, valid_front: pd.DataFrame, allow_invalid_dp: bool,
                       max_peak_mia: float | None, min_test_acc: float | None,
                       scope: str) -> UserInputError:
    """One error naming the constraints that excluded the front trials and the closest ones."""
    parts, binding = [], []
    if max_peak_mia is not None:
        over = int((valid_front[MIA] > max_peak_mia).sum())
        if over:
            binding.append(("--max-peak-mia", max_peak_mia))
            parts.append(f"{over} have peak MIA accuracy > {max_peak_mia:g}")
    if min_test_acc is not None:
        under = int((valid_front[ACC] < min_test_acc).sum())
        if under:
            binding.append(("--min-test-acc", min_test_acc))
            parts.append(f"{under} have test accuracy < {min_test_acc:g}")
    kind = "front trials" if allow_invalid_dp else "valid-DP front trials"
    text = (f"of the {len(valid_front)} {kind} ({scope}), " + " and ".join(parts)
            if len(valid_front) else f"no {kind} ({scope})")
    invalid = pool[~pool["dp_valid"]]
    if not allow_invalid_dp and len(invalid):
        would = front_of(pool)
        would = would[(~would["dp_valid"]) & _meets(would, max_peak_mia=max_peak_mia,
                                                     min_test_acc=min_test_acc)]
        text += (f"; {len(invalid)} audited trials were excluded because their "
                 f"{INVALID_TAG} (--allow-invalid-dp admits them"
                 + (f"; {len(would)} of them would qualify)" if len(would) else
                    "; none of them would qualify either)"))
    closest = _closest(valid_front if len(valid_front) else front_of(pool),
                       max_peak_mia=max_peak_mia, min_test_acc=min_test_acc)
    if closest:
        text += "; closest: " + "; ".join(closest)
    if not binding:
        binding = [("--allow-invalid-dp", False)]
    field = "/".join(name for name, _ in binding)
    value = binding[0][1] if len(binding) == 1 else tuple(v for _, v in binding)
    return UserInputError(field=field, value=value,
                          allowed=f"a constraint that some trial meets: {text}")


def _spec_of(data: RunData, row: pd.Series, checkpoint: Path) -> dict[str, Any]:
    """The trial's spec: spec.json beside its records, else the one pinned in the checkpoint."""
    for directory in trial_dirs(data.run_dir, row):
        path = directory / "spec.json"
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise UserInputError(field="spec", value=str(path),
                                     allowed=f"valid JSON ({exc})") from None
    from trainables.training import load_checkpoint_state  # torch: only when needed

    return dict(load_checkpoint_state(checkpoint)["spec"])


def config_from_spec(spec: dict[str, Any]) -> Config:
    """A full, validated config that reproduces the trial described by ``spec``.

    Method parameters keep only the method's hyperparameters: entries a method computes in
    its once-per-sweep preparation (e.g. LM-DP-SGD's risk vector) are recomputed on a rerun.
    The preset is resolved already (its values are in the spec), so it is left empty.
    """
    from trainables.methods import METHODS

    params = {k: v for k, v in (spec.get("method_params") or {}).items()
              if k not in PREPARED_PARAMS}
    cls = METHODS.get(str(spec.get("method")))
    if cls is not None:
        params = {k: v for k, v in params.items() if k in cls.extra_params}
    sizes = spec.get("sizes") or {}
    cal = spec["calibration"]
    device = str(spec.get("device", "auto"))
    raw = {
        "data": {"dataset": spec["dataset"], "data_dir": spec.get("data_dir") or "",
                 "split_seed": int(spec.get("split_seed", 0)),
                 "train_size": int(sizes.get("train", 0)),
                 "holdout_size": int(sizes.get("holdout", 0)),
                 "test_size": int(sizes.get("test", 0)),
                 "shadow_size": int(sizes.get("shadow", 0))},
        "model": {"name": spec.get("model", "auto"), "activation": spec.get("activation", "tanh")},
        "privacy": {"epsilon": float(cal["target_epsilon"]), "delta": float(cal["delta"])},
        "training": {"method": spec["method"], "preset": "", "batch_size": int(spec["batch_size"]),
                     "epochs": int(spec["epochs"]), "lr": float(spec["lr"]),
                     "clip_norm": float(spec["clip_norm"]),
                     "momentum": float(spec.get("momentum", 0.0)),
                     "max_physical_batch": int(spec.get("max_physical_batch", 512)),
                     "seed": int(spec.get("seed", 0))},
        "resources": {"cpus_per_trial": int(spec.get("threads", 1)),
                      "gpus_per_trial": 1.0 if device == "cuda" else 0.0, "device": device},
        # a sweep over this method alone; `dpsweep train` on this config retrains the trial
        "sweep": {"methods": [spec["method"]], "trials_per_method": 1},
        "method_params": params,
    }
    return from_dict(raw)


def _toml_safe(value: Any) -> Any:
    """TOML has no null and pick.toml should not hold NaN: drop both, recursively."""
    if isinstance(value, dict):
        return {str(k): _toml_safe(v) for k, v in value.items()
                if v is not None and not (isinstance(v, float) and math.isnan(v))}
    if isinstance(value, (list, tuple)):
        return [_toml_safe(v) for v in value if v is not None]
    return value


def _privacy_of(data: RunData, row: pd.Series) -> dict[str, Any]:
    """The privacy record's scalar fields (and noise schedule), else the row's copy of them."""
    record_rel = row.get("privacy_record")
    path = data.run_dir / str(record_rel) if isinstance(record_rel, str) and record_rel else None
    if path is not None and path.is_file():
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserInputError(field="privacy_record", value=str(path),
                                 allowed=f"valid JSON ({exc})") from None
        out = {k: record[k] for k in PRIVACY_FIELDS if k in record}
        out["noise_schedule"] = list(record.get("noise_schedule") or [])
        out["record"] = str(path.resolve())
        return out
    out = {k: (row[k].item() if hasattr(row[k], "item") else row[k])
           for k in PRIVACY_FIELDS if k in row.index}
    out["mechanism"] = "poisson_subsampled_gaussian"
    out["noise_schedule"] = data.parsed[row["trial_id"]]["noise_schedule"]
    out["record"] = "(privacy.json missing: copied from the results row)"
    return out


def pick(run_dir: Path, *, max_peak_mia: float | None, min_test_acc: float | None,
         method: str | None, allow_invalid_dp: bool) -> PickResult:
    """Choose the trial, write ``run_dir/pick.toml``, return what was chosen."""
    _check_constraints(max_peak_mia=max_peak_mia, min_test_acc=min_test_acc)
    data = load_run(Path(run_dir))
    frame = data.frame
    if method is not None:
        methods = sorted(frame["method"].unique())
        if method not in methods:
            raise UserInputError(field="--method", value=method,
                                 allowed=f"a method of this run: {methods}")
        frame = frame[frame["method"] == method]
    scope = f"method {method}" if method else "all methods"
    pool = eligible(frame)
    if pool.empty:
        finished = int((frame["status"] == "ok").sum())
        raise UserInputError(
            field="RUN_DIR", value=str(data.run_dir),
            allowed=(f"finished trials with a peak MIA accuracy ({scope}: {finished} finished, "
                     "none audited; run the audit first)") if finished else
                    f"at least one finished trial ({scope}: none finished)")
    valid_pool = pool if allow_invalid_dp else pool[pool["dp_valid"]]
    front = front_of(valid_pool)
    qualifying = _ranked(front[_meets(front, max_peak_mia=max_peak_mia,
                                      min_test_acc=min_test_acc)])
    if qualifying.empty:
        raise _nothing_qualifies(pool=pool, valid_front=front, allow_invalid_dp=allow_invalid_dp,
                                 max_peak_mia=max_peak_mia, min_test_acc=min_test_acc,
                                 scope=scope)
    best = qualifying.iloc[0]
    relative = best["checkpoint"] if isinstance(best["checkpoint"], str) else ""
    checkpoint = (data.run_dir / relative).resolve()
    if not relative or not checkpoint.is_dir():
        raise UserInputError(field="checkpoint",
                             value=str(checkpoint) if relative else "(none recorded)",
                             allowed=f"the checkpoint directory of the picked trial "
                                     f"{best['trial_id']!r} (missing)")
    spec = _spec_of(data, best, checkpoint)
    try:
        config = config_from_spec(spec)
    except UserInputError as exc:
        raise UserInputError(field="config", value=f"trial {best['trial_id']}",
                             allowed=f"a spec that maps onto a valid config ({exc})") from None
    privacy = _privacy_of(data, best)
    constraints = {"max_peak_mia": max_peak_mia, "min_test_acc": min_test_acc,
                   "method": method, "allow_invalid_dp": allow_invalid_dp}
    result = PickResult(
        trial_id=str(best["trial_id"]), method=str(best["method"]), mode=str(best["mode"]),
        test_accuracy=float(best[ACC]), peak_mia_accuracy=float(best[MIA]),
        peak_layer=str(best["peak_layer"]), dp_valid=bool(best["dp_valid"]),
        validity_reason=str(best["validity_reason"]), checkpoint=checkpoint, config=config,
        privacy=privacy, constraints=constraints,
        qualifying=tuple(qualifying["trial_id"].astype(str)),
        path=data.run_dir.resolve() / PICK_FILE)
    _write(result)
    return result


def _write(result: PickResult) -> None:
    document = {
        "selection": {
            "constraints": {k: v for k, v in result.constraints.items() if v is not None},
            "trial_id": result.trial_id, "method": result.method, "mode": result.mode,
            "test_accuracy": result.test_accuracy,
            "peak_mia_accuracy": result.peak_mia_accuracy, "peak_layer": result.peak_layer,
            "dp_valid": result.dp_valid, "validity_reason": result.validity_reason,
            "qualifying_front_trials": list(result.qualifying),
        },
        "config": result.config.to_dict(),
        "checkpoint": {"path": str(result.checkpoint)},
        "privacy": result.privacy,
    }
    text = ("# dpsweep pick: the chosen trial. [config] is a full dpsweep config that reproduces "
            f"it;\n# {PICK_CONFIG_FILE} holds it alone: dpsweep train {PICK_CONFIG_FILE} "
            "--out DIR retrains the trial.\n" + tomli_w.dumps(_toml_safe(document)))
    config_text = (f"# dpsweep config of trial {result.trial_id} (written by dpsweep pick)\n"
                   + result.config.to_toml())
    for path, content in ((result.path.with_name(PICK_CONFIG_FILE), config_text),
                          (result.path, text)):
        tmp = path.with_suffix(".toml.tmp")
        tmp.write_text(content, encoding="utf-8")
        os.replace(tmp, path)


def format_pick(result: PickResult) -> str:
    """What the terminal shows after a pick."""
    p = result.privacy
    c = result.constraints

    def opt(value: Any) -> str:
        return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

    eps = p.get("epsilon_upper")
    lines = [f"picked trial {result.trial_id} ({result.method}"
             + (f", mode {result.mode}" if result.mode else "") + ")",
             f"  test accuracy      {result.test_accuracy:.4f}",
             f"  peak MIA accuracy  {result.peak_mia_accuracy:.4f}"
             + (f" (layer {result.peak_layer})" if result.peak_layer else ""),
             f"  privacy            epsilon <= {opt(eps)} (target {opt(p.get('target_epsilon'))},"
             f" delta {opt(p.get('delta'))}, accountant {p.get('accountant', '?')}), "
             f"sigma {opt(p.get('noise_multiplier'))}",
             f"  constraints        max peak MIA {opt(c['max_peak_mia'])}, min test accuracy "
             f"{opt(c['min_test_acc'])}, method {c['method'] or 'any'}; "
             f"{len(result.qualifying)} front trials qualified",
             f"  checkpoint         {result.checkpoint}",
             f"  written            {result.path}",
             f"  retrain with       dpsweep train {result.path.with_name(PICK_CONFIG_FILE)} "
             "--out DIR"]
    if not result.dp_valid:
        lines.insert(1, f"  WARNING: {INVALID_TAG} (admitted by --allow-invalid-dp): "
                        f"{result.validity_reason}")
    return "\n".join(lines)
