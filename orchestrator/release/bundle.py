"""``dpsweep export``'s directory: what the epsilon covers, and what a stranger needs to use it.

The export is a new directory (names in ``core.layout``) holding:

* ``weights.pt`` — the network's ``state_dict`` only (``torch.load(..., weights_only=True)``);
* ``model.safetensors`` — the same tensors in the safetensors format;
* ``model.json`` — how to rebuild the network (builder and arguments, input shape, the classes
  in label order, the input kind and normalisation, each code file's SHA-256): no data, no
  seeds, no paths;
* ``load.py`` and ``code/`` — a plain-Python loader and the network's source
  (``orchestrator.release.standalone``), so the model runs without dpsweep, the run directory
  or the training machine's code folder;
* ``privacy_statement.json`` / ``privacy_statement.md`` — what the epsilon covers, how it was
  computed, and what it does not cover (``orchestrator.release.statement``), with the SHA-256
  of every other file.

Everything is checked before anything is written, and the release is assembled in a staging
directory next to ``out`` and renamed into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from dpsweep.core.errors import UserInputError
from dpsweep.core.layout import (
    EXPORT_CODE,
    EXPORT_LOADER,
    EXPORT_MODEL,
    EXPORT_SAFETENSORS,
    EXPORT_STATEMENT_JSON,
    EXPORT_STATEMENT_MD,
    EXPORT_WEIGHTS,
)
from dpsweep.core.records import PrivacyRecord
from dpsweep.core.storage import TMP_PREFIX, atomic_write_bytes, json_bytes
from dpsweep.orchestrator.release import standalone
from dpsweep.orchestrator.release.model_card import (
    fresh_model,
    load_instructions,
    model_description,
    source_of,
)
from dpsweep.orchestrator.release.statement import PrivacyStatement, privacy_statement
from dpsweep.orchestrator.rundir import check_creatable
from dpsweep.trainables.models.networks import WrappedModel
from dpsweep.trainables.training.loop import load_checkpoint_state

__all__ = ["RELEASE_ENTRIES", "RELEASE_FILES", "ExportResult", "export_trial"]

#: The files at the top of every export, in writing order.
RELEASE_FILES = (EXPORT_WEIGHTS, EXPORT_SAFETENSORS, EXPORT_MODEL, EXPORT_LOADER,
                 EXPORT_STATEMENT_JSON, EXPORT_STATEMENT_MD)
#: Everything at the top of an export: those files and the code folder; nothing else.
RELEASE_ENTRIES = (*RELEASE_FILES, EXPORT_CODE)

#: Permission bits a released file may get (read/write, never execute).
FILE_MODE_MASK = 0o666

ALLOW_REPLAYABLE_FLAG = "--allow-replayable"
ALLOW_INVALID_FLAG = "--allow-invalid-dp"
OUT_FIELD = "--out"
#: The first word of :meth:`ExportResult.summary`.
SUMMARY_VERB = "exported"
#: model.json's note on a trial exported at chance level.
DEGENERATE_NOTE = "exported with --allow-degenerate: the trial is at chance level"


def _bad(field: str, value: Any, allowed: str) -> UserInputError:
    return UserInputError(field=field, value=value, allowed=allowed)


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: ``files`` are its relative paths (``code/`` files included)."""

    out: Path
    files: tuple[str, ...]
    statement: PrivacyStatement
    model: dict[str, Any]

    def summary(self) -> str:
        """``exported OUT: <files>``, then any warning and the privacy headline, a line each
        (``pick --export`` puts the lines under its own ``exported`` label)."""
        code = sum(1 for f in self.files if f.startswith(f"{EXPORT_CODE}/"))
        counted = f"{code} file" if code == 1 else f"{code} files"
        names = [*RELEASE_FILES[:-2], f"{EXPORT_CODE}/ ({counted})", *RELEASE_FILES[-2:]]
        lines = [f"{SUMMARY_VERB} {self.out}: {', '.join(names)}"]
        if self.model.get("degenerate"):
            lines.append(f"WARNING: {self.model['degenerate']}")
        return "\n".join([*lines, self.statement.headline])


def export_trial(*, checkpoint_dir: Path, privacy: PrivacyRecord, out: Path,
                 tuning: dict[str, Any] | None = None,
                 audit_bound: dict[str, Any] | None = None, allow_replayable: bool = False,
                 allow_invalid_dp: bool = False, code_sha256: str | None = None,
                 degenerate: str | None = None, out_field: str = OUT_FIELD) -> ExportResult:
    """Write the release of the trial whose final checkpoint is ``checkpoint_dir``.

    Everything is validated before anything is written: a replayable (reproducible) trial or
    an invalid mode is refused unless explicitly allowed, ``out`` must be new or an empty
    directory, and the privacy record must match the checkpoint's trial and step count.
    ``code_sha256`` is the run's record of the user's code folder (manifest ``inputs``): the
    code shipped must be the code the weights were trained with. ``degenerate`` says why a trial
    at chance level is exported anyway (``--allow-degenerate``); model.json records it.
    ``out_field`` is the flag the user typed ``out`` as (``pick --export``), for the messages.
    """
    out = Path(out)
    _check_release_safe(privacy, allow_replayable=allow_replayable,
                        allow_invalid_dp=allow_invalid_dp)
    _check_out(out, field=out_field)
    state, statement = _final_state(Path(checkpoint_dir), privacy=privacy, tuning=tuning,
                                    audit_bound=audit_bound)
    info = model_description(state["spec"])
    origin, code = standalone.code_files(source_of(info))
    info["code"] = standalone.code_record(origin, code)
    _check_code(info, recorded=code_sha256)  # before the code is imported to build the model
    tensors, model_info = _released_weights(info, state["model"], checkpoint_dir)
    if "model_source" in info:  # the export's own copy of the code, not the training folder,
        # and no file path of the training machine (``standalone.portable_args``)
        source = info["model_source"]
        info["model_source"] = {**source, "code_dir": EXPORT_CODE,
                                "args": standalone.portable_args(dict(source["args"]))[0]}
    info.update(model_info)
    info.update({"weights": {"torch": EXPORT_WEIGHTS, "safetensors": EXPORT_SAFETENSORS},
                 "loader": EXPORT_LOADER})
    info["load"] = load_instructions(info, loader=EXPORT_LOADER, weights=EXPORT_WEIGHTS)
    if degenerate:
        info["degenerate"] = f"{DEGENERATE_NOTE} ({degenerate})"

    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    blobs: dict[str, bytes] = {
        EXPORT_WEIGHTS: buffer.getvalue(),
        EXPORT_SAFETENSORS: safetensors_bytes(tensors, metadata={"format": "pt"}),
        EXPORT_MODEL: json_bytes(info, allow_nan=False),
        EXPORT_LOADER: standalone.LOADER_SOURCE.read_bytes(),
        **{f"{EXPORT_CODE}/{name}": data for name, data in code.items()},
    }
    statement = replace(statement, artifacts={name: hashlib.sha256(data).hexdigest()
                                              for name, data in blobs.items()})
    blobs[EXPORT_STATEMENT_JSON] = json_bytes(statement.to_dict(), allow_nan=False)
    blobs[EXPORT_STATEMENT_MD] = statement.to_markdown().encode("utf-8")
    _write_release(out, blobs, field=out_field)
    return ExportResult(out=out, files=tuple(blobs), statement=statement, model=info)


def _check_release_safe(privacy: PrivacyRecord, *, allow_replayable: bool,
                        allow_invalid_dp: bool) -> None:
    """No epsilon holds for replayable noise or an invalid mode: refused unless asked for."""
    if not isinstance(privacy, PrivacyRecord):
        raise _bad("privacy", type(privacy).__name__,
                   "the trial's privacy record (a core.records.PrivacyRecord)")
    if (not privacy.release_safe or privacy.randomness == "reproducible") \
            and not allow_replayable:
        raise _bad("randomness", privacy.randomness,
                   f"a release-safe trial (secret or secure randomness): a reproducible trial's "
                   f"noise can be replayed from recorded seeds, so no epsilon holds for its "
                   f"release; pass {ALLOW_REPLAYABLE_FLAG} to export it anyway")
    if not privacy.dp_valid and not allow_invalid_dp:
        raise _bad("dp_valid", False,
                   f"a trial whose epsilon claim holds ({privacy.validity_reason}); "
                   f"pass {ALLOW_INVALID_FLAG} to export it anyway")


def _final_state(checkpoint_dir: Path, *, privacy: PrivacyRecord,
                 tuning: dict[str, Any] | None, audit_bound: dict[str, Any] | None
                 ) -> tuple[dict[str, Any], PrivacyStatement]:
    """The checkpoint (it must be the trial's last) and the statement of its privacy record."""
    state = load_checkpoint_state(checkpoint_dir)
    spec = state.get("spec")
    if not isinstance(spec, dict):
        raise _bad("checkpoint", str(checkpoint_dir), "a checkpoint with its trial spec")
    statement = privacy_statement(privacy=privacy, spec=spec, tuning=tuning,
                                  audit_bound=audit_bound)
    method_state = state.get("method")
    done = method_state.get("step_count") if isinstance(method_state, dict) else None
    if state.get("epoch") != spec.get("epochs") or done != statement.steps:
        raise _bad("checkpoint", str(checkpoint_dir),
                   f"the trial's final checkpoint (epoch {spec.get('epochs')}, "
                   f"{statement.steps} steps; this one is epoch {state.get('epoch')}, "
                   f"{done} steps)")
    return state, statement


def _released_weights(info: dict[str, Any], weights: Any, checkpoint_dir: Path
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors to release (a user's are their own module's, without the wrapper's
    prefix, so they load into what the factory returns) and model.json's layer fields; with
    ``[model] fix``, the modules the loader replaces (``torch.nn`` class and arguments) before
    loading them."""
    model = fresh_model(info)
    try:
        model.load_state_dict(weights, strict=True)
    except (RuntimeError, KeyError, TypeError) as exc:
        raise _bad("checkpoint", str(checkpoint_dir),
                   f"weights of a {info['architecture']} model "
                   f"({' '.join(str(exc).split())[:200]})") from None
    released = model.net if isinstance(model, WrappedModel) else model
    tensors = {k: v.detach().cpu().clone().contiguous()
               for k, v in released.state_dict().items()}
    fields: dict[str, Any] = {"layers": model.layer_names,
                              "layer_parameters": model.layer_sizes(),
                              "parameters": sum(p.numel() for p in model.parameters())}
    fixes = getattr(model, "model_fixes", None)  # ``[model] fix``: modules replaced in training
    if fixes:
        fields["build"] = {**info["build"], "replace": [
            {key: fix[key] for key in ("module", "kind", "kwargs")} for fix in fixes]}
    return tensors, fields


def _check_code(info: dict[str, Any], *, recorded: str | None) -> None:
    """The user's code folder must still be the one the run hashed: shipping edited code with
    the weights would rebuild another network (or fail to load)."""
    code = info["code"]
    if recorded is None or code["origin"] != standalone.ORIGIN_USER \
            or code["sha256"] == recorded:
        return
    raise _bad("model.code_dir", info["model_source"]["code_dir"],
               f"the code the run trained with (its .py files hashed to {recorded}; they now "
               f"hash to {code['sha256']}): restore them, then export")


def _check_out(out: Path, *, field: str) -> None:
    """``out`` is a new path, or an empty directory, where a directory can be created."""
    if out.is_symlink():
        raise _bad(field, str(out), "a path that is not a symbolic link")
    if out.is_dir() and any(out.iterdir()):
        raise _bad(field, str(out), "a new or empty directory for the release")
    check_creatable(out, field_name=field)


def _write_release(out: Path, blobs: dict[str, bytes], *, field: str) -> None:
    """Fill a staging directory beside ``out``, then rename it into place (all or nothing)."""
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = parent / f"{TMP_PREFIX}{out.name}-{secrets.token_hex(8)}"
        staging.mkdir()
    except OSError as exc:
        raise _bad(field, str(out), f"a location you can write ({exc.strerror})") from None
    try:
        # atomic_write's temporary files are private (0600); a release is meant to be shared,
        # so its files get the directory's umask-derived mode without the execute bits.
        file_mode = staging.stat().st_mode & FILE_MODE_MASK
        (staging / EXPORT_CODE).mkdir()
        for name, data in blobs.items():
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(atomic_write_bytes(target, data), file_mode)
        os.replace(staging, out)  # onto a missing path or an empty directory
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise _bad(field, str(out), f"a new or empty directory you can write "
                                        f"({exc.strerror})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_outside_run(out: Path, *, run_dir: Path, field: str = OUT_FIELD) -> None:
    """Refuse a release path inside the run directory (or the run directory itself), both
    resolved: a release is for sharing, the run directory is private (noiseless scores,
    checkpoints), and a release written into it would be shared with it or copied out of it."""
    run = Path(run_dir).resolve()
    target = Path(out).resolve()
    if target == run or run in target.parents:
        raise _bad(field, str(out), f"a directory outside the run directory {run} (a release "
                                    "is meant to be shared; the run directory is private and "
                                    "holds every trial's noiseless scores)")
