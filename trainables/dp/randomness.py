"""The randomness the privacy proof relies on: Poisson sampling and Gaussian noise.

A DP guarantee holds only if the adversary cannot predict the mechanism's randomness, and a
seed that can be searched is a predictable one: with w_0 and the released weights, an attacker
who tries every key subtracts the noise and recovers the un-noised gradient sum. By default
(``secret``) every trial keys its sampler and its noise with fresh OS entropy
(:func:`secret_key`, ``os.urandom``), at least ``KEY_BITS`` per generator, on every device:

- torch's CPU generator (mt19937) keeps only the low 32 bits of a ``manual_seed``, so its whole
  state is written from the key instead (:func:`cpu_generator`: 624 words, of which mt19937
  uses 19937 bits; the low 31 bits of word 0 never enter its output);
- every other torch generator (CUDA's, MPS's Philox) keeps a 64-bit seed, so
  :func:`fold_count` generators are each seeded with their own part of the key and their draws
  folded (:class:`TorchStream`): noise is the sum of their normals over sqrt(count), exactly
  standard normal, and a permutation their permutations composed, exactly uniform;
- the host's NumPy generator (batch sizes) is a PCG64 from a ``SeedSequence`` of ``KEY_BITS``.

The key lives only in memory and is never written or logged (checkpoints omit the generators'
states, so a resumed trial continues with fresh entropy, which the proof allows: each step
only needs noise independent of everything before it). Initialisation, data order outside the
proof and public-data batches stay seeded (``TrialSpec.seed``). A secret generator is not a
CSPRNG: it resists a search over keys, not an adversary who sees enough raw outputs of it to
solve for mt19937's state (the released weights carry the noise only added to a gradient).

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

import functools
import math
import os
import secrets
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.core.records import RANDOMNESS_KINDS
from dpsweep.trainables.engine.host_reads import to_device

#: Box–Muller samples summed per secure Gaussian coordinate (Opacus's secure_mode uses 4).
SECURE_SUMMANDS = 4
#: Bits of a float64 mantissa: uniforms are (k + 1/2) / 2^53 for a uniform 53-bit integer k.
_MANTISSA_BITS = 53
#: OS-entropy bits that key each secret generator at the least (a search of 2^128 is out of reach).
KEY_BITS = 128
_BITS_PER_BYTE = 8
#: Bits of a ``manual_seed`` that torch's generator of a device type keeps (CPU: mt19937 takes
#: the low 32; Philox, every other device's: 64).
SEED_BITS = {"cpu": 32}
DEFAULT_SEED_BITS = 64
#: Device types whose generator takes the whole key in its state (:func:`cpu_generator`);
#: every other device folds several seeded generators (:func:`fold_count`).
FULL_STATE_DEVICES = frozenset({"cpu"})

# torch's CPU generator state (``CPUGeneratorImplState``, checked by :func:`check_cpu_layout`):
# uint64 the_initial_seed; int32 left; int32 seeded; uint64 next; uint64 state[624] (one 32-bit
# word in each low half); double normal_x, normal_y, normal_rho; int32 normal_is_valid (+4 pad);
# float next_float_normal_sample; bool its valid flag (+3 pad).
MT_WORDS = 624
_MT_WORD_BYTES = 4
_MT_SLOT = np.dtype("<u8")
_MT_HEADER = struct.Struct("<QiiQ")
_MT_TAIL_BYTES = 40
CPU_STATE_BYTES = _MT_HEADER.size + MT_WORDS * _MT_SLOT.itemsize + _MT_TAIL_BYTES
#: mt19937's seeding recurrence (Matsumoto & Nishimura), to recognise a seeded state.
_MT_INIT_MULTIPLIER = 1812433253
_MT_INIT_SHIFT = 30
_MT_WORD_MASK = 0xFFFFFFFF
#: The one bit of word 0 that mt19937's twist reads.
_MT_UPPER_BIT = 0x80000000
#: A seed above 2^32, so the layout check sees the initial seed kept in 64 bits.
_LAYOUT_PROBE_SEED = 0x1234_5678_9ABC_DEF0
#: ``left`` = 1 makes the first draw twist (mix) the whole state before any output.
_TWIST_ON_FIRST_DRAW = 1
_SEEDED = 1


def secret_key(nbytes: int) -> bytes:
    """``nbytes`` of OS entropy; callers must never store or log them (tests replace this)."""
    return secrets.token_bytes(nbytes)


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


def _mt_seeded_words(seed: int) -> list[int]:
    """The 624 words mt19937's initialisation derives from the low 32 bits of ``seed``."""
    words = [seed & _MT_WORD_MASK]
    for i in range(1, MT_WORDS):
        prev = words[-1]
        words.append((_MT_INIT_MULTIPLIER * (prev ^ (prev >> _MT_INIT_SHIFT)) + i)
                     & _MT_WORD_MASK)
    return words


def check_cpu_layout(state: torch.Tensor, *, seed: int) -> None:
    """Raise unless ``state`` (a CPU generator's, just after ``manual_seed(seed)``) has the
    layout :func:`cpu_generator` writes: a key written at the wrong offsets would key the
    generator with less (or nothing) of it, silently."""
    raw = state.numpy().tobytes()
    if len(raw) != CPU_STATE_BYTES:
        raise RuntimeError(f"torch's CPU generator state is {len(raw)} bytes, not the "
                           f"{CPU_STATE_BYTES} of the mt19937 layout secret randomness keys; "
                           "refusing to key it (trainables/dp/randomness.py)")
    initial, left, seeded, nxt = _MT_HEADER.unpack_from(raw)
    words = np.frombuffer(raw, dtype=_MT_SLOT, count=MT_WORDS, offset=_MT_HEADER.size)
    expected = np.array(_mt_seeded_words(seed), dtype=_MT_SLOT)
    tail = raw[_MT_HEADER.size + MT_WORDS * _MT_SLOT.itemsize:]
    if (initial, left, seeded, nxt) != (seed, 1, _SEEDED, 0) \
            or not np.array_equal(words, expected) or any(tail):
        raise RuntimeError("torch's CPU generator state does not have the mt19937 layout "
                           "secret randomness keys (header, 624 words, cached normals); "
                           "refusing to key it (trainables/dp/randomness.py)")


@functools.cache
def _cpu_layout_checked() -> bool:
    """Check the installed torch's layout once per process (:func:`check_cpu_layout`)."""
    probe = torch.Generator().manual_seed(_LAYOUT_PROBE_SEED)
    check_cpu_layout(probe.get_state(), seed=_LAYOUT_PROBE_SEED)
    return True


def cpu_generator(key: bytes) -> torch.Generator:
    """A CPU generator whose whole mt19937 state is ``key`` (624 little-endian 32-bit words).

    Its initial seed is 0 (nothing of the key in ``initial_seed()``) and ``left`` is 1, so the
    first draw twists the whole state; the cached normals are marked invalid.
    """
    if len(key) != MT_WORDS * _MT_WORD_BYTES:
        raise ValueError(f"an mt19937 key is {MT_WORDS * _MT_WORD_BYTES} bytes, not {len(key)}")
    words = np.frombuffer(key, dtype="<u4")
    if not (int(words[0]) & _MT_UPPER_BIT or words[1:].any()):
        raise RuntimeError("the OS entropy source returned an all-zero mt19937 state "
                           "(mt19937 would output only zeros): refusing to key with it")
    _cpu_layout_checked()
    raw = bytearray(CPU_STATE_BYTES)
    _MT_HEADER.pack_into(raw, 0, 0, _TWIST_ON_FIRST_DRAW, _SEEDED, 0)
    slots = np.frombuffer(raw, dtype=_MT_SLOT, count=MT_WORDS, offset=_MT_HEADER.size)
    slots[:] = words  # a writable view of ``raw``: the words land in the slots' low halves
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(raw, dtype=torch.uint8))
    return generator


def fold_count(device_type: str) -> int:
    """Generators folded per stream on ``device_type``: enough seeds to hold KEY_BITS."""
    return math.ceil(KEY_BITS / SEED_BITS.get(device_type, DEFAULT_SEED_BITS))


def fold_seeds(key: bytes, *, device_type: str) -> list[int]:
    """``key`` cut into :func:`fold_count` seeds of the width ``device_type``'s generator
    keeps (every byte in exactly one seed)."""
    width = SEED_BITS.get(device_type, DEFAULT_SEED_BITS) // _BITS_PER_BYTE
    folds = fold_count(device_type)
    if len(key) != folds * width:
        raise ValueError(f"a folded {device_type} key is {folds * width} bytes, not {len(key)}")
    return [int.from_bytes(key[i * width:(i + 1) * width], "little") for i in range(folds)]


class TorchStream:
    """Normals and permutations on one device from one torch generator, or folded from several
    independently keyed ones (a seed too short for the key: :func:`fold_count`).

    Folding keeps the distributions exact: the sum of m independent standard normals over
    sqrt(m) is standard normal, and a uniform permutation composed with any independent one is
    uniform. Guessing a folded stream means guessing every generator's seed at once.
    """

    def __init__(self, generators: Sequence[torch.Generator], *, device: torch.device) -> None:
        if not generators:
            raise ValueError("a stream needs at least one generator")
        self.generators = tuple(generators)
        self.device = torch.device(device)

    @property
    def generator(self) -> torch.Generator:
        """The one generator of an unfolded stream (a reproducible checkpoint's state)."""
        if len(self.generators) != 1:
            raise ValueError("a folded stream has no single generator state")
        return self.generators[0]

    def randn(self, shape: torch.Size | tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
        first, *rest = self.generators
        total = torch.randn(shape, generator=first, device=self.device, dtype=dtype)
        for g in rest:
            total.add_(torch.randn(shape, generator=g, device=self.device, dtype=dtype))
        return total.mul_(1.0 / math.sqrt(len(self.generators))) if rest else total

    def randperm(self, n: int) -> torch.Tensor:
        first, *rest = self.generators
        order = torch.randperm(n, generator=first, device=self.device)
        for g in rest:
            order = order[torch.randperm(n, generator=g, device=self.device)]
        return order


def secret_stream(device: torch.device, *, fold: bool | None = None) -> TorchStream:
    """A stream on ``device`` keyed by fresh OS entropy (at least KEY_BITS, see module doc):
    the whole mt19937 state on a FULL_STATE_DEVICES device, else :func:`fold_count` seeded
    generators (``fold=True`` forces that on the CPU too, so tests run the folded path)."""
    device = torch.device(device)
    if fold is None:
        fold = device.type not in FULL_STATE_DEVICES
    if not fold:
        if device.type != "cpu":
            raise ValueError(f"only the CPU generator's whole state can be keyed, not {device}")
        return TorchStream([cpu_generator(secret_key(MT_WORDS * _MT_WORD_BYTES))], device=device)
    width = SEED_BITS.get(device.type, DEFAULT_SEED_BITS) // _BITS_PER_BYTE
    seeds = fold_seeds(secret_key(fold_count(device.type) * width), device_type=device.type)
    return TorchStream([torch.Generator(device=device).manual_seed(s) for s in seeds],
                       device=device)


def secret_host_generator() -> np.random.Generator:
    """The host's generator (batch sizes, masks): PCG64 from KEY_BITS of OS entropy."""
    entropy = int.from_bytes(secret_key(KEY_BITS // _BITS_PER_BYTE), "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


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

    Three sources (none in secure mode): ``noise``, a :class:`TorchStream` on ``device``;
    ``host``, a NumPy generator for batch sizes and :meth:`poisson_mask`; ``subset``, a stream
    on ``sample_device`` that picks each batch's members given its size. Each secret one is
    keyed by its own fresh key (module doc).
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
        self._noise: TorchStream | None = None
        self._host: np.random.Generator | None = None
        self._subset: TorchStream | None = None
        if kind == "reproducible":
            noise_seed, host_seed, subset_seed = (
                int(v) for v in np.random.SeedSequence([seed, 0xD9]).generate_state(3))
            self._noise = TorchStream(
                [torch.Generator(device=self.device).manual_seed(noise_seed)], device=self.device)
            self._host = np.random.Generator(np.random.PCG64(host_seed))
            self._subset = TorchStream(
                [torch.Generator(device=self.sample_device).manual_seed(subset_seed)],
                device=self.sample_device)
        elif kind == "secret":  # keyed in this order: noise, batch sizes, subsets
            self._noise = secret_stream(self.device)
            self._host = secret_host_generator()
            self._subset = secret_stream(self.sample_device)

    @property
    def release_safe(self) -> bool:
        return self.kind != "reproducible"

    def normal(self, shape: torch.Size | tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
        """Standard normal noise of ``shape`` on the device (secure: drawn on the host and
        copied without waiting for the device, see :func:`to_device`)."""
        if self._noise is not None:
            return self._noise.randn(shape, dtype=dtype)
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
        order = self._subset.randperm(n)
        return order[:k].sort().values

    def state(self) -> dict[str, Any] | None:
        """Generator states for a checkpoint: only reproducible randomness may be written."""
        if self.kind != "reproducible":
            return None
        assert self._noise is not None and self._host is not None and self._subset is not None
        return {"noise": self._noise.generator.get_state(),
                "host": dict(self._host.bit_generator.state),
                "subset": self._subset.generator.get_state(),
                "sample_device": self.sample_device.type}

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
        self._noise.generator.set_state(state["noise"])
        self._host.bit_generator.state = state["host"]
        self._subset.generator.set_state(state["subset"])


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
