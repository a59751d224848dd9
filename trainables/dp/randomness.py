"""The randomness the privacy proof relies on: Poisson sampling and Gaussian noise.

A DP guarantee holds only if the adversary cannot predict the mechanism's randomness. By default
every trial draws a fresh 63-bit seed from the operating system's entropy pool (``secrets``)
for its sampler and its noise; the seed lives only in memory and is never written (checkpoints
omit the generators' states, so a resumed trial continues with fresh entropy, which the proof
allows: each step only needs noise independent of everything before it). Initialisation, data
order outside the proof and public-data batches stay seeded (``TrialSpec.seed``).

``reproducible`` trials (debugging, tests) seed sampling and noise from the recorded seed as
well, so a replay gives bit-identical weights: they are marked unsafe to release.

A Poisson batch (each example independently with probability q) is drawn in two stages that
need no host read of a device value: its size k ~ Binomial(n, q) on the host (a NumPy
generator: a size must be known to the host to slice anyway), then a uniformly random k-subset
on the data's device (``torch.randperm`` from a device generator, the first k, sorted for
gather locality). Given its size, a Poisson batch is a uniform subset of that size, so the two
stages draw exactly the Poisson distribution, without a per-example mask whose ``nonzero``
would make the host wait for the device at every step.

``secure`` trials draw both from a cryptographically secure source (``os.urandom``) instead of
torch's Mersenne Twister / Philox, and sample each Gaussian coordinate as the normalised sum of
several Box–Muller samples computed in float64. The sum follows Holohan & Braghin (2021),
"Secure Random Sampling in Differential Privacy" (arXiv 2107.10138), the mitigation Opacus's
``secure_mode`` also uses, against the floating-point attacks of Jin et al. (2022), "Are We
There Yet? Timing and Floating-Point Attacks on Differential Privacy Systems" (arXiv
2112.05307), which distinguish neighbouring inputs from the low-order bits of a single
textbook Gaussian sample added in floating point. Timing side channels are not addressed.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from core.errors import UserInputError
from core.records import RANDOMNESS_KINDS
from trainables.engine.host_reads import to_device

#: Box–Muller samples summed per secure Gaussian coordinate (Opacus's secure_mode uses 4).
SECURE_SUMMANDS = 4
#: Bits of a float64 mantissa: uniforms are (k + 1/2) / 2^53 for a uniform 53-bit integer k.
_MANTISSA_BITS = 53


def secret_seed() -> int:
    """63 bits from the OS entropy pool; callers must never store or log it."""
    return secrets.randbits(63)


def _secure_uniform(n: int) -> np.ndarray:
    """``n`` float64 uniforms in (0, 1) from ``os.urandom`` (never 0: Box–Muller takes a log)."""
    words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(64 - _MANTISSA_BITS)
    return (words.astype(np.float64) + 0.5) / float(1 << _MANTISSA_BITS)


def _secure_standard_normal(n: int) -> np.ndarray:
    """``n`` standard normals: the sum of SECURE_SUMMANDS Box–Muller samples over sqrt(count)."""
    total = np.zeros(n, dtype=np.float64)
    pairs = (n + 1) // 2
    for _ in range(SECURE_SUMMANDS):
        u1, u2 = _secure_uniform(pairs), _secure_uniform(pairs)
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2.0 * math.pi * u2
        total += np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
    return total / math.sqrt(SECURE_SUMMANDS)



def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device ("cuda" and "cuda:0" are, as torch places
    them)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class Randomness:
    """The sampler's and the noise's random source for one trial.

    ``kind`` is ``secret`` (fresh OS entropy, default), ``reproducible`` (from ``seed``) or
    ``secure`` (CSPRNG and the summed Gaussian). Only reproducible sources have a state that a
    checkpoint may keep. Noise is drawn on ``device``; batch indices on ``sample_device`` (the
    data's device: the trial's device, or the CPU where the data stay in host memory).

    Three generators (none in secure mode): ``noise`` on ``device``; ``host``, a NumPy
    generator for batch sizes and :meth:`poisson_mask`; ``subset`` on ``sample_device``, which
    picks each batch's members given its size.
    """

    KINDS = RANDOMNESS_KINDS

    def __init__(self, *, kind: str, device: torch.device, seed: int | None = None,
                 sample_device: torch.device | None = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"randomness kind {kind!r} not in {self.KINDS}")
        if kind == "reproducible" and seed is None:
            raise ValueError("reproducible randomness needs a seed")
        self.kind = kind
        self.device = torch.device(device)
        self.sample_device = torch.device(device if sample_device is None else sample_device)
        self._noise: torch.Generator | None = None
        self._host: np.random.Generator | None = None
        self._subset: torch.Generator | None = None
        if kind != "secure":
            if kind == "reproducible":
                noise_seed, host_seed, subset_seed = (
                    int(v) for v in np.random.SeedSequence([seed, 0xD9]).generate_state(3))
            else:
                noise_seed, host_seed, subset_seed = secret_seed(), secret_seed(), secret_seed()
            self._noise = torch.Generator(device=self.device).manual_seed(noise_seed)
            self._host = np.random.Generator(np.random.PCG64(host_seed))
            self._subset = torch.Generator(device=self.sample_device).manual_seed(subset_seed)

    @property
    def release_safe(self) -> bool:
        return self.kind != "reproducible"

    def normal(self, shape: torch.Size | tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
        """Standard normal noise of ``shape`` on the device (secure: drawn on the host and
        copied without waiting for the device, see :func:`to_device`)."""
        if self._noise is not None:
            return torch.randn(shape, generator=self._noise, device=self.device, dtype=dtype)
        n = math.prod(shape)
        values = torch.from_numpy(_secure_standard_normal(n)).reshape(shape).to(dtype)
        return to_device(values, self.device)

    def poisson_mask(self, n: int, *, rate: float) -> torch.Tensor:
        """Which of ``n`` examples join (each independently with ``rate``), as a boolean tensor
        on the host (the canary audits' draw; a training batch uses :meth:`poisson_indices`)."""
        if self._host is not None:
            return torch.from_numpy(self._host.random(n) < rate)
        return torch.from_numpy(_secure_uniform(n) < rate)

    def poisson_indices(self, n: int, *, rate: float) -> torch.Tensor:
        """The sorted indices of one Poisson batch of ``range(n)`` on ``sample_device``.

        Size ~ Binomial(n, rate) on the host, then a uniform subset of that size on the device
        (module docstring): no host read of a device value. Secure mode draws the per-example
        mask from ``os.urandom`` on the host and copies the indices (pinned, non-blocking):
        slower than the device draw, since the host touches every example every step.
        """
        if self._host is None:
            chosen = np.flatnonzero(_secure_uniform(n) < rate)
            return to_device(torch.from_numpy(chosen), self.sample_device)
        assert self._subset is not None
        k = int(self._host.binomial(n, rate))
        if k == 0:
            return torch.zeros(0, dtype=torch.long, device=self.sample_device)
        order = torch.randperm(n, generator=self._subset, device=self.sample_device)
        return order[:k].sort().values

    def state(self) -> dict[str, Any] | None:
        """Generator states for a checkpoint: only reproducible randomness may be written."""
        if self.kind != "reproducible":
            return None
        assert self._noise is not None and self._host is not None and self._subset is not None
        return {"noise": self._noise.get_state(), "host": dict(self._host.bit_generator.state),
                "subset": self._subset.get_state(), "sample_device": self.sample_device.type}

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Continue a reproducible trial bit-identically from :meth:`state` (the same kinds of
        device: a generator's state is only valid on its own kind)."""
        if self.kind != "reproducible":
            return  # fresh entropy continues the trial: nothing secret was stored
        if state is None:
            raise ValueError("a reproducible trial's checkpoint lacks its generator states")
        assert self._noise is not None and self._host is not None and self._subset is not None
        keys = {"noise", "host", "subset", "sample_device"}
        if not isinstance(state, dict) or set(state) != keys \
                or state["sample_device"] != self.sample_device.type:
            shown = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise UserInputError(
                field="checkpoint.randomness", value=shown,
                allowed=f"the generator states {sorted(keys)} of batches drawn on "
                        f"{self.sample_device.type} (a reproducible checkpoint written before "
                        "batches were drawn on the data's device, or with its data on another "
                        "kind of device, cannot continue bit-identically)")
        self._noise.set_state(state["noise"])
        self._host.bit_generator.state = state["host"]
        self._subset.set_state(state["subset"])


def poisson_batches(*, n: int, rate: float, steps: int, randomness: Randomness,
                    device: torch.device) -> Iterator[torch.Tensor]:
    """``steps`` Poisson batches of indices into ``range(n)`` on ``device`` (the data's),
    distributed as Opacus's ``UniformWithReplacementSampler`` draws them (each example
    independently with ``rate``), by :meth:`Randomness.poisson_indices`."""
    device = torch.device(device)
    if not _same_device(device, randomness.sample_device):
        raise ValueError(f"batches wanted on {device}, but the randomness draws them on "
                         f"{randomness.sample_device} (Randomness(sample_device=...))")
    for _ in range(steps):
        yield randomness.poisson_indices(n, rate=rate)
