"""The fraction of clipped examples per epoch (issue 43, item 3): counted per the method's own
rule from the norms it clips on, summed on the device, read once per epoch into history.json,
and declared not covered by the results store."""

from __future__ import annotations

import math

import torch

from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.reports.store import COLUMNS
from dpsweep.trainables.dp.step import ClipCount, clipped_fraction
from dpsweep.trainables.training.loop import CLIPPED_FRACTION, train_trial
from tests.conftest import tiny_config


def test_flat_clipping_counts_examples_whose_whole_norm_exceeds_the_sensitivity() -> None:
    # whole norms 5, 0.5, 0.9, sqrt(2)
    norms = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.9, 0.0], [1.0, 1.0]], dtype=torch.float64)
    fraction = clipped_fraction(norms, bounds=None, sensitivity=1.0)
    assert fraction is not None and float(fraction) == 0.5


def test_per_layer_clipping_counts_an_example_once_if_any_layer_exceeds_its_bound() -> None:
    norms = torch.tensor([[0.5, 0.1], [0.1, 3.0], [2.0, 3.0], [0.6, 0.6]])
    bounds = torch.tensor([1.0, 0.7], dtype=torch.float64)
    # each layer is under its bound for the first and last example, although the last one's
    # whole norm (0.85) exceeds no bound and the per-layer rule is what the method applies
    fraction = clipped_fraction(norms, bounds=bounds, sensitivity=math.hypot(1.0, 0.7))
    assert fraction is not None and float(fraction) == 0.5


def test_no_bound_or_no_example_counts_nothing() -> None:
    assert clipped_fraction(torch.ones(3, 2), bounds=None, sensitivity=math.inf) is None
    assert clipped_fraction(torch.ones(0, 2), bounds=None, sensitivity=1.0) is None
    count = ClipCount()
    assert count.take() is None
    count.add(None)
    count.add(torch.tensor(0.25, dtype=torch.float64))
    count.add(torch.tensor(0.75, dtype=torch.float64))
    assert count.take() == 0.5 and count.take() is None  # a mean per read, then restarted


def test_every_epoch_records_its_fraction_and_the_store_declares_it_not_covered() -> None:
    tight = train_trial(plan_trial(check(tiny_config(epochs=2, clip_norm=1e-3))))
    # a bound far above every norm, and a step too small for the noise (sigma C lr / B) to move
    # the weights towards norms that reach it
    loose = train_trial(plan_trial(check(tiny_config(epochs=1, clip_norm=1e4, lr=1e-9))))
    assert [h[CLIPPED_FRACTION] for h in tight.history] == [1.0, 1.0]
    assert loose.history[-1][CLIPPED_FRACTION] == 0.0
    assert not COLUMNS[CLIPPED_FRACTION].covered
