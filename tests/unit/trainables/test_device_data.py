"""Poisson batches drawn where the data live, the data's placement, and a trial's GPU share.

The sampler draws a batch's size ~ Binomial(n, q) on the host and a uniform subset of that size
on the data's device; checked here against the known answer of Poisson sampling: each example
joins with probability q, two examples independently (q^2), and the size is Binomial(n, q)
(chi-square). Everything runs seeded (reproducible kind), so the test is deterministic. The
placement and headroom rules are pure arithmetic, checked on the CPU; the CUDA measurement
itself cannot run here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpsweep.core.errors import UserInputError
from dpsweep.core.trial import TrialSpec
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import gpu_share, plan_trial
from dpsweep.trainables.dp.randomness import Randomness, poisson_batches
from dpsweep.trainables.training.loop import train_trial
from dpsweep.trainables.training.placement import (
    DATA_SHARE,
    HEADROOM,
    ON_DEVICE,
    PINNED_HOST,
    check_headroom,
    data_placement,
    gather,
)
from tests.conftest import tiny_config

CPU = torch.device("cpu")
GIB = 1 << 30
#: Small n and q, many draws: each frequency is within a few standard errors of its answer.
N, Q, DRAWS = 6, 0.3, 20_000
#: Standard errors a frequency may be from its expected value (deterministic: seeded draws).
SIGMAS = 5.0
#: Significance of the chi-square test of the batch sizes against Binomial(N, Q).
ALPHA = 1e-3


def _members(seed: int = 11) -> np.ndarray:
    """[DRAWS, N] membership of each example in each of DRAWS Poisson batches."""
    source = Randomness(kind="reproducible", device=CPU, seed=seed)
    out = np.zeros((DRAWS, N), dtype=bool)
    for t, idx in enumerate(poisson_batches(n=N, rate=Q, steps=DRAWS, randomness=source,
                                            device=CPU)):
        out[t, idx.numpy()] = True
    return out


@pytest.fixture(scope="module")
def members() -> np.ndarray:
    return _members()


def test_each_example_joins_with_probability_q(members: np.ndarray) -> None:
    se = math.sqrt(Q * (1 - Q) / DRAWS)
    assert np.all(np.abs(members.mean(axis=0) - Q) < SIGMAS * se)


def test_two_examples_join_independently(members: np.ndarray) -> None:
    both = (members[:, :, None] & members[:, None, :]).mean(axis=0)
    se = math.sqrt(Q * Q * (1 - Q * Q) / DRAWS)
    pairs = both[~np.eye(N, dtype=bool)]
    assert np.all(np.abs(pairs - Q * Q) < SIGMAS * se)


def test_batch_sizes_follow_the_binomial(members: np.ndarray) -> None:
    sizes = members.sum(axis=1)
    observed = np.bincount(sizes, minlength=N + 1)
    expected = stats.binom.pmf(np.arange(N + 1), N, Q) * DRAWS
    assert stats.chisquare(observed, expected).pvalue > ALPHA


def test_batches_are_sorted_distinct_indices_on_the_asked_device() -> None:
    source = Randomness(kind="reproducible", device=CPU, seed=2)
    for idx in poisson_batches(n=1000, rate=0.05, steps=20, randomness=source, device=CPU):
        assert idx.dtype == torch.long and idx.device == CPU
        assert torch.equal(idx, torch.unique(idx))  # sorted and distinct
        assert idx.numel() == 0 or 0 <= int(idx[0]) <= int(idx[-1]) < 1000
    with pytest.raises(ValueError, match="sample_device"):
        next(poisson_batches(n=10, rate=0.5, steps=1, randomness=source,
                             device=torch.device("meta")))


def test_secure_batches_are_poisson_too() -> None:
    source = Randomness(kind="secure", device=CPU)
    sizes = [len(idx) for idx in poisson_batches(n=2000, rate=0.1, steps=50,
                                                  randomness=source, device=CPU)]
    se = math.sqrt(2000 * 0.1 * 0.9 / 50)
    assert abs(np.mean(sizes) - 200) < SIGMAS * se


def test_a_reproducible_source_continues_bit_identically_from_its_state() -> None:
    """Every generator's state (noise, sizes, subsets) goes into the checkpoint."""
    def draws(source: Randomness, k: int) -> list[torch.Tensor]:
        out = []
        for idx in poisson_batches(n=300, rate=0.1, steps=k, randomness=source, device=CPU):
            out += [idx, source.normal((5,), dtype=torch.float32)]
        return out

    straight = Randomness(kind="reproducible", device=CPU, seed=4)
    draws(straight, 3)
    state = straight.state()
    expected = draws(straight, 4)
    resumed = Randomness(kind="reproducible", device=CPU, seed=99)
    resumed.load_state(state)
    assert all(torch.equal(a, b) for a, b in zip(draws(resumed, 4), expected, strict=True))
    assert set(state) == {"noise", "host", "subset", "sample_device"}


def test_secret_and_secure_sources_write_no_state() -> None:
    for kind in ("secret", "secure"):
        source = Randomness(kind=kind, device=CPU)
        next(poisson_batches(n=50, rate=0.2, steps=1, randomness=source, device=CPU))
        assert source.state() is None
        source.load_state(None)  # fresh entropy continues the trial


def test_an_old_reproducible_state_is_refused_by_name() -> None:
    old = {"noise": torch.Generator().get_state(), "sampler": torch.Generator().get_state()}
    with pytest.raises(UserInputError, match=r"checkpoint\.randomness"):
        Randomness(kind="reproducible", device=CPU, seed=1).load_state(old)


# ---- placement -----------------------------------------------------------------------------
def test_data_go_to_the_device_only_within_their_share_of_the_trials_memory() -> None:
    total = 80 * GIB
    budget = DATA_SHARE * 0.5 * total  # half a GPU, all of it free
    assert data_placement(data_bytes=int(budget), free_bytes=total, total_bytes=total,
                          share=0.5) == ON_DEVICE
    assert data_placement(data_bytes=int(budget) + 1, free_bytes=total, total_bytes=total,
                          share=0.5) == PINNED_HOST
    # less free than the share (neighbours hold the rest): the free memory bounds it
    assert data_placement(data_bytes=int(budget), free_bytes=10 * GIB, total_bytes=total,
                          share=0.5) == PINNED_HOST
    assert data_placement(data_bytes=0, free_bytes=0, total_bytes=total,
                          share=1.0) == ON_DEVICE


def test_gather_indexes_in_place_on_one_device() -> None:
    x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    idx = torch.tensor([1, 4, 7])
    xb, yb = gather(x, y, idx, device=CPU)
    assert torch.equal(xb, x[idx]) and torch.equal(yb, y[idx])


# ---- the GPU share -------------------------------------------------------------------------
def test_a_trial_within_its_share_passes() -> None:
    total = 80 * GIB
    check_headroom(peak_bytes=int(10 * GIB / HEADROOM), share=0.125, total_bytes=total,
                   max_physical_batch=512)


def test_a_trial_beyond_its_share_is_refused_in_one_line_that_says_what_to_change() -> None:
    total = 80 * GIB
    with pytest.raises(UserInputError) as err:
        check_headroom(peak_bytes=9 * GIB, share=0.125, total_bytes=total,
                       max_physical_batch=512)
    text = str(err.value)
    assert err.value.field == "resources.gpus_per_trial" and err.value.value == 0.125
    assert "\n" not in text
    assert f"{9 * HEADROOM:.2f} GiB" in text and "10.00 GiB" in text  # the need, the share
    assert "training.max_physical_batch (now 512)" in text
    assert text.startswith("resources.gpus_per_trial = 0.125 is not allowed")
    with pytest.raises(UserInputError, match="ran out of memory"):
        check_headroom(peak_bytes=None, share=0.5, total_bytes=total, max_physical_batch=64)


def test_the_planned_spec_carries_the_gpu_share() -> None:
    assert [gpu_share(g) for g in (0.0, 0.25, 1.0, 2.0)] == [1.0, 0.25, 1.0, 1.0]
    cfg = tiny_config()
    cfg = dataclasses.replace(cfg, resources=dataclasses.replace(cfg.resources,
                                                                 gpus_per_trial=0.25))
    spec = plan_trial(check(cfg, machine=False))  # planned for a GPU machine
    assert spec.gpu_share == 0.25
    assert TrialSpec.from_dict(spec.to_dict()) == spec


def test_a_stored_spec_without_a_share_reads_as_a_whole_gpu_and_stays_equal() -> None:
    spec = plan_trial(check(tiny_config()))
    stored = spec.to_dict()
    assert "gpu_share" not in stored  # a whole GPU is not written: older specs compare equal
    assert TrialSpec.from_dict(stored).gpu_share == 1.0
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(UserInputError, match=r"resources\.gpus_per_trial"):
            dataclasses.replace(spec, gpu_share=bad)


def test_a_cpu_trial_records_its_data_on_the_device() -> None:
    result = train_trial(plan_trial(check(tiny_config(epochs=1))))
    assert result.privacy_record.method_record["data_placement"] == ON_DEVICE
    assert math.isfinite(result.history[-1]["train_loss_nonprivate"])
