"""The randomness the privacy proof relies on is secret, fresh per trial, and never written."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from orchestrator.trial.single import TRIAL_ID, train_single
from tests.conftest import tiny_config
from trainables.dp import randomness
from trainables.dp.randomness import Randomness
from trainables.training.loop import load_checkpoint_state, load_spec, train_trial

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


def test_the_run_directory_holds_no_secret_and_cannot_replay_the_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets_drawn: list[int] = []
    real = randomness.secret_seed

    def recorded() -> int:
        secrets_drawn.append(real())
        return secrets_drawn[-1]

    monkeypatch.setattr(randomness, "secret_seed", recorded)
    run = tmp_path / "run"
    train_single(tiny_config(), out=run)
    assert len(secrets_drawn) == 3  # the noise's, the batch sizes' and the subsets'
    for path, data in _all_bytes(run):
        for seed in secrets_drawn:
            for form in (str(seed).encode(), f"{seed:x}".encode(),
                         struct.pack("<q", seed), struct.pack(">q", seed)):
                assert form not in data, f"{path} contains the secret seed"
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
    train_single(tiny_config(reproducible=True), out=run)
    trial = run / "trials" / TRIAL_ID
    spec = load_spec(json.loads((trial / "spec.json").read_text()))
    stored = load_checkpoint_state(trial / "checkpoint")["model"]
    replayed = load_checkpoint_state(train_trial(
        dataclasses.replace(spec), checkpoint_root=tmp_path / "replay",
        rolling_checkpoint="checkpoint").checkpoint_dir)["model"]
    assert all(torch.equal(stored[k], replayed[k]) for k in stored)
