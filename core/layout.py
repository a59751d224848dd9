"""The run directory's layout: every file name of a run and of a trial (and of an export),
written once.

Training (``trainables``) writes a trial's records, the driver (``orchestrator``) the run's, the
report (``reports``) reads both; each imports its names from here, so a name cannot drift
between writer and reader. ``orchestrator.rundir.RunDir`` owns what is done with the files
(manifest, hashes, lock); this module only names them.
"""

from __future__ import annotations

# ---- the run -----------------------------------------------------------------------------------
#: The sweep's configuration as given (verified against the manifest on every read).
CONFIG = "config.toml"
#: Every file dpsweep wrote, with its SHA-256.
MANIFEST = "manifest.json"
#: What the report's header and the export's tuning statement read.
SUMMARY = "summary.json"
#: Every attempt at the sweep (the run, then each resume): started, and how and when it ended.
ATTEMPTS = "attempts.json"
#: One row per trial (Parquet).
RESULTS = "results.parquet"
#: Optuna's storage (SQLite).
OPTUNA_DB = "optuna.db"
#: The exclusive writer's lock and its holder.
LOCK = ".lock"
LOCK_INFO = ".lock.json"
#: Budget calibrations cached for this run.
CACHE = "cache"
#: One folder per trial.
TRIALS = "trials"
#: Ray Tune's own experiment files (never loaded).
TUNE = "tune"
#: The HTML report and its figures and tables.
REPORT = "report"
#: Private tuning's plan and the secret trial count's draw.
PRIVATE_TUNING = "private_tuning.json"
#: What ``dpsweep pick`` chose, and the chosen trial's config.
PICK = "pick.toml"
PICK_CONFIG = "pick_config.toml"

# ---- a trial (``trials/<id>/``) ----------------------------------------------------------------
SPEC = "spec.json"
HISTORY = "history.json"
PRIVACY = "privacy.json"
AUDIT = "audit.json"
#: Every audited candidate's pool index, membership and score per layer x attack (numpy npz).
AUDIT_SCORES = "audit_scores.npz"
#: The audit's signals (target and its own references) and the target's own cells, from which
#: a sweep scores the audit again with the references of its study's other trials (numpy npz).
AUDIT_SIGNALS = "audit_signals.npz"
#: ``dpsweep audit``'s canary record, one per kind (white-box, black-box): ``.format(kind=...)``.
CANARY_AUDIT = "canary_audit_{kind}.json"
#: Written last: the trial finished (RESULT) or failed with its reason (ERROR).
RESULT = "result.json"
ERROR = "error.json"
#: The rolling checkpoint: the last epoch's state is the final model.
CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_FILE = "state.pt"
#: A trial's record files, in the order training writes them.
TRIAL_FILES = (SPEC, HISTORY, PRIVACY, AUDIT_SIGNALS, AUDIT_SCORES, AUDIT, RESULT, ERROR)

# ---- an export (``dpsweep export --out DIR``: what leaves the run) -----------------------------
#: The released network's ``state_dict``: torch's format (``weights_only`` loading) and
#: safetensors.
EXPORT_WEIGHTS = "weights.pt"
EXPORT_SAFETENSORS = "model.safetensors"
#: How to rebuild the network: builder, classes, input kind and normalisation, code hashes.
EXPORT_MODEL = "model.json"
#: What the epsilon covers and what it does not, for a machine and for a reviewer.
EXPORT_STATEMENT_JSON = "privacy_statement.json"
EXPORT_STATEMENT_MD = "privacy_statement.md"
#: A plain-Python loader (stdlib + torch): rebuilds the network from EXPORT_CODE, loads the
#: weights and wraps the network in its input normalisation (``orchestrator/release/loader.py``).
EXPORT_LOADER = "load.py"
#: The network's Python source: the ``.py`` files of the user's code folder, or the dpsweep
#: modules a built-in model is made of.
EXPORT_CODE = "code"
