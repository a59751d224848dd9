"""The randomness the privacy proof relies on: Poisson sampling and Gaussian noise.

A DP guarantee holds only if the adversary cannot predict the mechanism's randomness. By default
every trial draws a fresh 63-bit seed from the operating system's entropy pool (``secrets``)
for its sampler and its noise; the seed lives only in memory and is never written (checkpoints
omit the generators' states, so a resumed trial continues with fresh entropy, which the proof
allows: each step only needs noise independent of everything before it). Initialisation, data
order outside the proof and public-data batches stay seeded (``TrialSpec.seed``).

``reproducible`` trials (debugging, tests) seed sampling and noise from the recorded seed as
well, so a replay gives bit-identical weights: they are marked unsafe to release.

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
from typing import Any

import numpy as np
import torch

from core.records import RANDOMNESS_KINDS

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


class Randomness:
    """The sampler's and the noise's random source for one trial.

    ``kind`` is ``secret`` (fresh OS entropy, default), ``reproducible`` (from ``seed``) or
    ``secure`` (CSPRNG and the summed Gaussian). Only reproducible sources have a state that a
    checkpoint may keep.
    """

    KINDS = RANDOMNESS_KINDS

    def __init__(self, *, kind: str, device: torch.device, seed: int | None = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"randomness kind {kind!r} not in {self.KINDS}")
        if kind == "reproducible" and seed is None:
            raise ValueError("reproducible randomness needs a seed")
        self.kind = kind
        self.device = torch.device(device)
        self._noise: torch.Generator | None = None
        self._sampler: torch.Generator | None = None
        if kind != "secure":
            if kind == "reproducible":
                noise_seed, sampler_seed = (int(v) for v in
                                            np.random.SeedSequence([seed, 0xD9]).generate_state(2))
            else:
                noise_seed, sampler_seed = secret_seed(), secret_seed()
            self._noise = torch.Generator(device=self.device).manual_seed(noise_seed)
            self._sampler = torch.Generator().manual_seed(sampler_seed)

    @property
    def release_safe(self) -> bool:
        return self.kind != "reproducible"

    def normal(self, shape: torch.Size | tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
        """Standard normal noise of ``shape`` on the device."""
        if self._noise is not None:
            return torch.randn(shape, generator=self._noise, device=self.device, dtype=dtype)
        n = math.prod(shape)
        values = torch.from_numpy(_secure_standard_normal(n)).reshape(shape)
        return values.to(device=self.device, dtype=dtype)

    def poisson_mask(self, n: int, *, rate: float) -> torch.Tensor:
        """Which of ``n`` examples enter this step's batch (each independently with ``rate``)."""
        if self._sampler is not None:
            return torch.rand(n, generator=self._sampler) < rate
        return torch.from_numpy(_secure_uniform(n) < rate)

    def state(self) -> dict[str, Any] | None:
        """Generator states for a checkpoint: only reproducible randomness may be written."""
        if self.kind != "reproducible":
            return None
        assert self._noise is not None and self._sampler is not None
        return {"noise": self._noise.get_state(), "sampler": self._sampler.get_state()}

    def load_state(self, state: dict[str, Any] | None) -> None:
        if self.kind != "reproducible":
            return  # fresh entropy continues the trial: nothing secret was stored
        if state is None:
            raise ValueError("a reproducible trial's checkpoint lacks its generator states")
        assert self._noise is not None and self._sampler is not None
        self._noise.set_state(state["noise"])
        self._sampler.set_state(state["sampler"])


def poisson_batches(*, n: int, rate: float, steps: int, randomness: Randomness):
    """``steps`` Poisson batches of indices into ``range(n)``, as Opacus's
    ``UniformWithReplacementSampler`` draws them (one Bernoulli(rate) per example per step)."""
    for _ in range(steps):
        yield torch.nonzero(randomness.poisson_mask(n, rate=rate), as_tuple=False).reshape(-1)
