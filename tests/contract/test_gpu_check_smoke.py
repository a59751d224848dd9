"""``bench.gpu_check``, the prepared GPU script of issue 33, end to end in its CPU dry run.

A lent GPU machine's time is scarce, so the script must not fail there for a reason the CPU
could have shown: ``--device cpu --smoke`` runs every section's code path (tiny rounds, the
bundled digits, two sharing processes) and each section must hold numbers or say why not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]
TOP_KEYS = ("device", "device_slug", "torch", "python", "git_commit", "source_digest",
            "sections", "seconds_total", "budget_s", "smoke")
SMOKE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu",
                           "--smoke", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=SMOKE_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "gpu_check_cpu.json").read_text())


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def _reason(value: Any) -> str | None:
    if isinstance(value, dict):
        for key in ("skipped", "error"):
            if isinstance(value.get(key), str) and value[key]:
                return value[key]
    return None


@pytest.mark.slow
def test_the_smoke_run_writes_every_key_and_section(smoke: dict[str, Any]) -> None:
    assert all(k in smoke for k in TOP_KEYS), sorted(smoke)
    assert smoke["device_slug"] == "cpu" and smoke["smoke"] is True
    for name in gpu_check.SECTIONS:
        assert name in smoke, name
        status = smoke["sections"][name]
        assert status["seconds"] >= 0
        # numbers, or a recorded reason; an error in the dry run would be one on the GPU too
        assert _numbers(smoke[name]) or _reason(smoke[name]), (name, smoke[name])
        assert status["status"] != "error", (name, smoke[name].get("error"))


@pytest.mark.slow
def test_the_smoke_run_measures_what_the_gpu_run_will(smoke: dict[str, Any]) -> None:
    row = smoke["timing"]["cnn28@16"]
    assert row["entries"]["non-private"]["median_ms"] > 0
    assert row["entries"]["method dpsgd"]["median_ms"] > 0
    assert "method dpsgd / non-private" in row["ratios"]
    methods = smoke["methods"]["cnn28@16"]["methods"]
    assert methods["dpsgd"]["ratio_median"] == 1.0 and len(methods) >= 2
    trial = smoke["fmnist_trial"]
    assert trial["train_s"] > 0 and 0 <= trial["test_accuracy"] <= 1
    assert trial["epsilon_upper"] == pytest.approx(2.985, abs=0.01)
    syncs = smoke["host_syncs"]
    assert isinstance(syncs["forbid_host_reads"].get("raised"), bool), syncs["forbid_host_reads"]
    assert "marginal_per_step" in syncs["trial_loop"]
    shared = smoke["shared_gpu"]
    assert shared["throughput_ratio"] > 0 and shared["randomness"] == "secret"
    assert shared["weights_differ"] is True  # each process drew its own noise

