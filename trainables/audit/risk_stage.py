"""What LM-DP-SGD's stage 1 (``trainables.audit.layer_risk``) is asked for: its hyperparameters
and the smallest shadow pool it can use. Kept apart from the estimate, which needs torch and
scikit-learn, so the method (``trainables.methods.lm_dpsgd``) validates a config against these
without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Fewest shadow-pool examples stage 1 can split into attack fitting and evaluation.
MIN_STAGE1_EXAMPLES = 20


@dataclass(frozen=True)
class Stage1:
    """Hyperparameters of the risk estimate; all of them are part of the cache key."""

    examples: int  # shadow-pool examples used (half members, half non-members); 0 = all
    steps: int  # shadow-model Adam steps
    batch_size: int
    lr: float
    attack: str
    er_eval: str

    @classmethod
    def from_params(cls, p: dict[str, Any]) -> Stage1:
        return cls(examples=int(p["stage1_examples"]), steps=int(p["stage1_steps"]),
                   batch_size=int(p["stage1_batch_size"]), lr=float(p["stage1_lr"]),
                   attack=str(p["attack"]), er_eval=str(p["er_eval"]))
