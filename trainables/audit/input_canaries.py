"""Black-box canaries for the one-run audit: m mislabelled holdout examples, each joining the
training set with probability 1/2, scored by their negative loss on the trained model.

The audit's design, the white-box canaries and what the scores become are
:mod:`trainables.audit.canaries`; this module holds only the input canaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.audit.canaries import CANARY_POOL, CanaryCounts, check_count

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.data.splits import DataSplits
    from dpsweep.trainables.dp.randomness import Randomness
    from dpsweep.trainables.dp.step import DPStep
else:
    torch = lazy_module("torch")

#: Separates the pool picks' stream of the audit seed from the other uses
#: (``trainables.audit.canaries``' streams).
_POOL_STREAM = 0xCA12


@dataclass(frozen=True, eq=False)
class InputCanaries:
    """m mislabelled examples from the holdout split (public design: inputs and labels)."""

    x: torch.Tensor
    y: torch.Tensor  # the wrong labels the canaries carry
    true_y: torch.Tensor
    pool_indices: np.ndarray  # indices in the dataset's pooled example list

    @property
    def m(self) -> int:
        return len(self.y)

    def to_dict(self) -> dict[str, Any]:
        return {"m": self.m, "pool": CANARY_POOL, "pool_indices": self.pool_indices.tolist(),
                "labels": self.y.tolist(), "true_labels": self.true_y.tolist()}


def choose_input_canaries(data: DataSplits, *, m: int, seed: int) -> InputCanaries:
    """m holdout examples with uniformly random wrong labels (seeded from the audit seed)."""
    pool = getattr(data, CANARY_POOL)
    m = check_count(m, limit=len(pool), what=f"examples in the {CANARY_POOL} split, the pool "
                                              "black-box canaries come from")
    used = np.concatenate([data.train.indices, data.validation.indices, data.test.indices,
                           data.shadow.indices])
    rng = np.random.default_rng([int(seed), _POOL_STREAM])
    pick = np.sort(rng.choice(len(pool), size=m, replace=False))
    indices = np.asarray(pool.indices)[pick]
    if np.intersect1d(indices, used).size:
        raise RuntimeError(f"the {CANARY_POOL} split overlaps the trial's other splits")
    true_y = pool.y[torch.from_numpy(pick)]
    shift = torch.from_numpy(rng.integers(1, data.num_classes, size=m)).to(true_y.dtype)
    return InputCanaries(x=pool.x[torch.from_numpy(pick)], y=(true_y + shift) % data.num_classes,
                         true_y=true_y, pool_indices=indices)


class BlackBoxInstrument:
    """``train_trial(instrument=...)``: each IN canary joins each Poisson batch with rate q."""

    def __init__(self, *, canaries: InputCanaries, is_member: np.ndarray,
                 sampler: Randomness) -> None:
        self.canaries = canaries
        self.is_member = np.asarray(is_member, dtype=bool)
        if self.is_member.shape != (canaries.m,):
            raise ValueError(f"is_member has shape {self.is_member.shape}, "
                             f"expected ({canaries.m},)")
        self.sampler = sampler
        self.counts = CanaryCounts()
        self.method: DPStep | None = None

    def __call__(self, method: DPStep) -> None:
        self.method = method
        device = next(method.model.parameters()).device
        members = torch.from_numpy(self.is_member)
        x_in = self.canaries.x[members].to(device)
        y_in = self.canaries.y[members].to(device)
        rate = method.ledger.sample_rate
        step = method.step

        def canary_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            joining = self.sampler.poisson_mask(len(y_in), rate=rate).to(device)
            self.counts.steps += 1
            self.counts.joins += int(joining.sum())
            losses = step(torch.cat([x, x_in[joining]]), torch.cat([y, y_in[joining]]))
            return losses[:x.shape[0]]

        method.step = canary_step  # type: ignore[method-assign]

    @torch.no_grad()
    def scores(self) -> np.ndarray:
        """Minus each canary's loss (with its wrong label) under the trained model."""
        if self.method is None:
            raise RuntimeError("the instrument was never installed (train_trial did not run)")
        model = self.method.model
        model.eval()
        device = next(model.parameters()).device
        logits = model(self.canaries.x.to(device))
        loss = torch.nn.functional.cross_entropy(logits, self.canaries.y.to(device),
                                                 reduction="none")
        return -loss.double().cpu().numpy()
