"""The randomness the privacy proof relies on is secret, fresh per trial, and never written."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.single import TRIAL_ID, train_single
from dpsweep.trainables.dp import randomness
from dpsweep.trainables.dp.randomness import Randomness
from dpsweep.trainables.training.loop import load_checkpoint_state, load_spec, train_trial
from tests.conftest import tiny_config

DRAWS = 100_000
#: |correlation| of 1e5 independent standard normals is below 0.05 with overwhelming
#: probability (its standard deviation is 1/sqrt(1e5) = 0.003).
MAX_CORRELATION = 0.05


def _noise(kind: str, seed: int | None = None) -> np.ndarray:
    source = Randomness(kind=kind, device=torch.device("cpu"), seed=seed)
    return source.normal((DRAWS,), dtype=torch.float64).numpy()


def test_two_trials_draw_uncorrelated_noise_even_with_the_same_recorded_seed() -> None:
    a, b = _noise("secret"), _noise("secret")
    assert abs(np.corrcoef(a, b)[0, 1]) < MAX_CORRELATION
    assert not np.array_equal(a, b)


def test_reproducible_noise_replays_and_is_flagged_unsafe() -> None:
    assert np.array_equal(_noise("reproducible", 7), _noise("reproducible", 7))
    assert Randomness(kind="reproducible", device=torch.device("cpu"), seed=7).release_safe \
        is False
    assert Randomness(kind="secret", device=torch.device("cpu")).state() is None


def test_secure_gaussian_is_standard_normal_and_uses_no_torch_generator() -> None:
    values = _noise("secure")
    assert stats.kstest(values, "norm").pvalue > 1e-3
    source = Randomness(kind="secure", device=torch.device("cpu"))
    assert source._noise is None and source._host is None and source._subset is None
    mask = source.poisson_mask(DRAWS, rate=0.1)
    assert abs(float(mask.double().mean()) - 0.1) < 0.005


def _all_bytes(root: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()]


def _key_forms(key: bytes) -> list[bytes]:
    """How a key could show up in a file: raw 16-byte pieces, hex, its first word as a number."""
    word = int.from_bytes(key[:8], "little")
    pieces = [key[i:i + 16] for i in range(0, len(key) - 15, 16)]
    return [*pieces, key[:16].hex().encode(), str(word).encode(), f"{word:x}".encode()]


def test_the_run_directory_holds_no_secret_and_cannot_replay_the_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys_drawn: list[bytes] = []
    real = randomness.secret_key

    def recorded(nbytes: int) -> bytes:
        keys_drawn.append(real(nbytes))
        return keys_drawn[-1]

    monkeypatch.setattr(randomness, "secret_key", recorded)
    run = tmp_path / "run"
    train_single(check(tiny_config()), out=run)
    assert len(keys_drawn) == 3  # the noise's, the batch sizes' and the subsets'
    assert min(len(k) for k in keys_drawn) * 8 >= randomness.KEY_BITS
    for path, data in _all_bytes(run):
        for key in keys_drawn:
            for form in _key_forms(key):
                assert form not in data, f"{path} contains secret key material"
    trial = run / "trials" / TRIAL_ID
    spec = load_spec(json.loads((trial / "spec.json").read_text()))
    assert spec.randomness == "secret"
    stored = load_checkpoint_state(trial / "checkpoint")["model"]
    replay = train_trial(spec, checkpoint_root=tmp_path / "replay",
                         rolling_checkpoint="checkpoint")
    replayed = load_checkpoint_state(replay.checkpoint_dir)["model"]
    assert any(not torch.equal(stored[k], replayed[k]) for k in stored)


def test_a_reproducible_trial_replays_bit_identically(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_single(check(tiny_config(reproducible=True)), out=run)
    trial = run / "trials" / TRIAL_ID
    spec = load_spec(json.loads((trial / "spec.json").read_text()))
    stored = load_checkpoint_state(trial / "checkpoint")["model"]
    replayed = load_checkpoint_state(train_trial(
        dataclasses.replace(spec), checkpoint_root=tmp_path / "replay",
        rolling_checkpoint="checkpoint").checkpoint_dir)["model"]
    assert all(torch.equal(stored[k], replayed[k]) for k in stored)


# --------------------------------------------------------------------------------------------
# Key width: every bit of a secret key keys the stream (the CPU generator kept 32 of 63)

CPU = torch.device("cpu")
#: Seeds what these tests control (stand-in keys), so every statistical check is deterministic.
KEY_TEST_SEED = 20_240_917
#: Bytes two keys share in the finding's tests: the 32 bits ``manual_seed`` keeps on the CPU,
#: and the 64 a Philox seed holds.
SHARED_PREFIXES = (4, 8)
#: The CPU's full-state keying, and the folded keying of an accelerator, forced onto the CPU.
PATHS = ("full_state", "folded")
POPULATION = 1_000
FOLDED_DRAWS = 1_000_000
#: 5 standard errors of the mean (1/sqrt(n)) and of the sample std (about 1/sqrt(2n)).
MEAN_TOLERANCE = 5 / FOLDED_DRAWS ** 0.5
STD_TOLERANCE = 5 / (2 * FOLDED_DRAWS) ** 0.5
PERM_SIZE = 4
PERM_DRAWS = 12_000
MIN_PVALUE = 1e-3
#: mt19937's state: 624 32-bit words (written here, not read from the module under test).
MT_WORDS = 624
MT_KEY_BYTES = MT_WORDS * 4
MT_UPPER_BIT = 0x8000_0000
#: float64 normals that read all 624 words of the first twisted state (two words each).
MT_STREAM_DRAWS = MT_WORDS


def _keys(*, shared: int, trial: int) -> Callable[[int], bytes]:
    """A stand-in entropy source: every key's first ``shared`` bytes the same in each trial, the
    rest drawn per trial."""
    rng = np.random.default_rng([KEY_TEST_SEED, trial])

    def key(nbytes: int) -> bytes:
        return np.random.default_rng(KEY_TEST_SEED).bytes(nbytes)[:shared] \
            + rng.bytes(nbytes - shared)

    return key


def _fixed_key(nbytes: int) -> bytes:
    return np.random.default_rng(KEY_TEST_SEED).bytes(nbytes)


def _secret(monkeypatch: pytest.MonkeyPatch, *, keys: Callable[[int], bytes],
            path: str) -> Randomness:
    monkeypatch.setattr(randomness, "secret_key", keys)
    if path == "folded":
        monkeypatch.setattr(randomness, "FULL_STATE_DEVICES", frozenset())
    return Randomness(kind="secret", device=CPU)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shared", SHARED_PREFIXES)
def test_keys_agreeing_in_their_low_bits_draw_different_noise_and_batches(
        monkeypatch: pytest.MonkeyPatch, shared: int, path: str) -> None:
    """The finding: ``manual_seed(s)`` and ``manual_seed(s + 2**32)`` give one CPU stream, so a
    63-bit seed was a 32-bit key. Keys that agree in their first 32 (or 64) bits must not."""
    a = _secret(monkeypatch, keys=_keys(shared=shared, trial=1), path=path)
    b = _secret(monkeypatch, keys=_keys(shared=shared, trial=2), path=path)
    assert len(a._noise.generators) == (1 if path == "full_state" else 4)
    assert not torch.equal(a.normal((DRAWS,), dtype=torch.float64),
                           b.normal((DRAWS,), dtype=torch.float64))
    assert not torch.equal(a.poisson_indices(POPULATION, rate=0.5),
                           b.poisson_indices(POPULATION, rate=0.5))
    assert not torch.equal(a.poisson_mask(POPULATION, rate=0.5),
                           b.poisson_mask(POPULATION, rate=0.5))  # the host's PCG64


def _cpu_draws(monkeypatch: pytest.MonkeyPatch, key: bytes) -> torch.Tensor:
    monkeypatch.setattr(randomness, "secret_key", lambda nbytes: key[:nbytes])
    return randomness.secret_stream(CPU).randn((MT_STREAM_DRAWS,), dtype=torch.float64)


def test_every_word_of_the_cpu_key_changes_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """All 624 words key mt19937 (of word 0 only the top bit: its twist never reads the rest,
    so mt19937's state holds 19937 bits). A short prefix of the stream reads only the words that
    mixed into its first outputs, so the draw spans a whole twisted state."""
    base = _fixed_key(MT_KEY_BYTES)
    reference = _cpu_draws(monkeypatch, base)
    for i in range(MT_WORDS):
        for bit in (MT_UPPER_BIT,) if i == 0 else (MT_UPPER_BIT, 1):
            words = np.frombuffer(base, dtype="<u4").copy()
            words[i] ^= np.uint32(bit)
            assert not torch.equal(_cpu_draws(monkeypatch, words.tobytes()), reference), (i, bit)


def test_a_keyed_cpu_state_is_the_key_and_replays_from_its_bytes() -> None:
    """The layout, checked on the installed torch: the key sits in the 624 slots' low halves,
    nothing of it in ``initial_seed()``; the first draw twists; the state's bytes replay it."""
    key = _fixed_key(MT_KEY_BYTES)
    g = randomness.cpu_generator(key)
    raw = g.get_state().numpy().tobytes()
    initial, left, seeded, _ = struct.unpack_from("<QiiQ", raw)
    slots = np.frombuffer(raw, dtype="<u8", count=MT_WORDS, offset=24)
    assert (initial, left, seeded, g.initial_seed()) == (0, 1, 1, 0)
    assert np.array_equal(slots, np.frombuffer(key, dtype="<u4"))
    twin = torch.Generator()
    twin.set_state(g.get_state())
    first = torch.randn(DRAWS, generator=g), torch.randperm(POPULATION, generator=g)
    assert torch.equal(first[0], torch.randn(DRAWS, generator=twin))
    assert torch.equal(first[1], torch.randperm(POPULATION, generator=twin))
    after = np.frombuffer(g.get_state().numpy().tobytes(), dtype="<u8",
                          count=MT_WORDS, offset=24)
    assert not np.array_equal(after, slots)  # twisted
    other = randomness.cpu_generator(_keys(shared=0, trial=3)(MT_KEY_BYTES))
    assert not torch.equal(first[0], torch.randn(DRAWS, generator=other))


def test_a_layout_other_than_the_expected_one_fails_loudly() -> None:
    seed = 0x1_0000_0005
    state = torch.Generator().manual_seed(seed).get_state()
    randomness.check_cpu_layout(state, seed=seed)
    with pytest.raises(RuntimeError, match="bytes"):
        randomness.check_cpu_layout(state[:-8], seed=seed)
    shifted = state.clone()
    shifted[24:32], shifted[32:40] = state[32:40].clone(), state[24:32].clone()
    with pytest.raises(RuntimeError, match="layout"):
        randomness.check_cpu_layout(shifted, seed=seed)
    with pytest.raises(RuntimeError, match="layout"):
        randomness.check_cpu_layout(state, seed=seed + 1)


def test_a_degenerate_or_short_key_is_refused() -> None:
    with pytest.raises(RuntimeError, match="all-zero"):
        randomness.cpu_generator(bytes(MT_KEY_BYTES))
    unused = (MT_UPPER_BIT - 1).to_bytes(4, "little") + bytes(MT_KEY_BYTES - 4)
    with pytest.raises(RuntimeError, match="all-zero"):  # only bits mt19937 never reads
        randomness.cpu_generator(unused)
    with pytest.raises(ValueError, match="bytes"):
        randomness.cpu_generator(bytes(16))


def test_keying_refuses_a_torch_whose_state_layout_differs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout check guards every keying, not only the unit call above."""
    randomness._cpu_layout_checked.cache_clear()
    monkeypatch.setattr(randomness, "CPU_STATE_BYTES", randomness.CPU_STATE_BYTES - 8)
    try:
        with pytest.raises(RuntimeError, match="bytes"):
            Randomness(kind="secret", device=CPU)
    finally:
        randomness._cpu_layout_checked.cache_clear()


def test_folding_holds_the_key_width_on_every_device() -> None:
    """Philox (CUDA, MPS) keeps 64-bit seeds: two of them; a CPU seed keeps 32 bits: four."""
    assert randomness.fold_count("cuda") == 2 and randomness.fold_count("mps") == 2
    assert randomness.fold_count("cpu") == 4
    key = _fixed_key(16)
    for device_type, width in (("cuda", 8), ("cpu", 4)):
        seeds = randomness.fold_seeds(key, device_type=device_type)
        assert b"".join(s.to_bytes(width, "little") for s in seeds) == key
    with pytest.raises(ValueError, match="bytes"):
        randomness.fold_seeds(key[:8], device_type="cuda")


def test_the_host_generator_takes_128_bits_and_every_one_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    key = bytearray(_fixed_key(16))

    def source(nbytes: int) -> bytes:
        asked.append(nbytes)
        return bytes(key)

    monkeypatch.setattr(randomness, "secret_key", source)
    first = randomness.secret_host_generator().random(8)
    key[-1] ^= 0x80  # the top bit of the 128
    assert not np.array_equal(randomness.secret_host_generator().random(8), first)
    assert asked == [16, 16]


def test_folded_noise_is_the_normalised_sum_and_standard_normal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(randomness, "secret_key", _fixed_key)
    stream = randomness.secret_stream(CPU, fold=True)
    values = stream.randn((FOLDED_DRAWS,), dtype=torch.float64)
    key = _fixed_key(16)
    parts = [torch.randn(FOLDED_DRAWS, dtype=torch.float64, generator=torch.Generator()
                         .manual_seed(int.from_bytes(key[4 * i:4 * i + 4], "little")))
             for i in range(4)]
    assert torch.allclose(values, sum(parts) / 2, rtol=0, atol=1e-12)
    x = values.numpy()
    assert abs(x.mean()) < MEAN_TOLERANCE and abs(x.std() - 1) < STD_TOLERANCE
    assert stats.kstest(x, "norm").pvalue > MIN_PVALUE


def test_folded_permutations_are_uniform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(randomness, "secret_key", _fixed_key)
    stream = randomness.secret_stream(CPU, fold=True)
    seen: dict[tuple[int, ...], int] = {}
    for _ in range(PERM_DRAWS):
        perm = tuple(stream.randperm(PERM_SIZE).tolist())
        seen[perm] = seen.get(perm, 0) + 1
    assert all(sorted(p) == list(range(PERM_SIZE)) for p in seen)
    assert len(seen) == math.factorial(PERM_SIZE)
    assert stats.chisquare(list(seen.values())).pvalue > MIN_PVALUE


def test_folded_batches_are_sorted_subsets(monkeypatch: pytest.MonkeyPatch) -> None:
    source = _secret(monkeypatch, keys=_fixed_key, path="folded")
    sizes = []
    for _ in range(200):
        idx = source.poisson_indices(POPULATION, rate=0.1)
        assert torch.equal(idx, idx.unique()) and (idx.numel() == 0 or int(idx[-1]) < POPULATION)
        sizes.append(idx.numel())
    assert abs(np.mean(sizes) - 100) < 5  # Binomial(1000, 0.1): std of the mean 0.67


def test_reproducible_streams_are_the_recorded_seeds_generators() -> None:
    """Reproducible mode keeps its keying: the recorded seed's SeedSequence seeds one generator
    each, so old checkpoints and replays stay bit-identical."""
    noise_seed, host_seed, subset_seed = (
        int(v) for v in np.random.SeedSequence([7, 0xD9]).generate_state(3))
    source = Randomness(kind="reproducible", device=CPU, seed=7)
    expected = torch.randn(DRAWS, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(noise_seed))
    assert torch.equal(source.normal((DRAWS,), dtype=torch.float64), expected)
    k = int(np.random.Generator(np.random.PCG64(host_seed)).binomial(POPULATION, 0.1))
    order = torch.randperm(POPULATION, generator=torch.Generator().manual_seed(subset_seed))
    assert torch.equal(source.poisson_indices(POPULATION, rate=0.1), order[:k].sort().values)
    saved = source.state()
    again = Randomness(kind="reproducible", device=CPU, seed=99)
    again.load_state(saved)
    assert torch.equal(again.normal((8,), dtype=torch.float64),
                       source.normal((8,), dtype=torch.float64))
