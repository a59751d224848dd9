"""The non-private loop's per-epoch hook (what the sweep's baseline job reports its progress
from) is heard once per epoch, in eval mode, and changes nothing the loop learns."""

from __future__ import annotations

import torch

from dpsweep.trainables.audit.references import NonPrivateRecipe, train_nonprivate
from dpsweep.trainables.data.splits import SplitSizes, load_splits

SIZES = SplitSizes(train=120, validation=60, holdout=60, test=60, shadow=60)
EPOCHS = 3


def test_each_epoch_is_heard_in_eval_mode_and_training_is_unchanged() -> None:
    data = load_splits(dataset="digits", seed=0, sizes=SIZES)
    recipe = NonPrivateRecipe(epochs=EPOCHS, batch_size=32)
    heard: list[tuple[int, bool]] = []

    def on_epoch(epoch: int, model: torch.nn.Module) -> None:
        heard.append((epoch, model.training))
        with torch.no_grad():
            model(data.validation.x)  # what the baseline job does: evaluate

    plain, _ = train_nonprivate(data=data, recipe=recipe, seed=3)
    told, seconds = train_nonprivate(data=data, recipe=recipe, seed=3, on_epoch=on_epoch)
    assert heard == [(k, False) for k in range(1, EPOCHS + 1)]
    assert seconds > 0
    for (name, a), (_, b) in zip(plain.state_dict().items(), told.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
