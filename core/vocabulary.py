"""The words records are written in: trial statuses, the split names, the disk-full key.

Each is written here once; every module that writes or reads a record imports it, so a record
written by the driver and read by the report cannot disagree on a spelling.
"""

from __future__ import annotations

from typing import Final

#: A trial that trained to its end and has every record.
OK: Final = "ok"
#: A trial whose training raised: its row keeps the true reason.
FAILED: Final = "failed"
#: A trial stopped at a rung by the pruner (its epsilon spent so far is recorded).
PRUNED: Final = "pruned"
#: A trial whose worker stopped (a signal, a lost node, a full disk): it runs again on resume.
INTERRUPTED: Final = "interrupted"
#: Every status a results row may carry.
STATUSES: Final = (OK, FAILED, PRUNED, INTERRUPTED)

#: The four private splits a trial and its audit use, then the public shadow pool.
SPLIT_NAMES: Final[tuple[str, ...]] = ("train", "validation", "holdout", "test", "shadow")
#: The splits cut from private data (a public pool, when given, replaces ``shadow``).
PRIVATE_SPLITS: Final[tuple[str, ...]] = SPLIT_NAMES[:4]

#: The key under which a trial's metrics say that the disk filled and where.
DISK_FULL_KEY: Final = "disk_full"

#: The objectives a sampler can see, as studies and tuning records name them: noiseless
#: validation accuracy, the in-trial attack's peak accuracy on training members (adaptive
#: tuning), the noisy validation score (private tuning).
VALIDATION_OBJECTIVE: Final = "val_accuracy"
ATTACK_OBJECTIVE: Final = "peak_mia_accuracy"
NOISY_OBJECTIVE: Final = "noisy_val_score"
