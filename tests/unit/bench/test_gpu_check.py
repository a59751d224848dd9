"""``bench.gpu_check``, the prepared GPU script of issue 33: its device slugs, the data it asks
to be carried, and that it imports nothing from tests. Its CPU dry run end to end (a process of
its own) is tests/contract/test_gpu_check_smoke.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check_trial import DataMissing, find_data

ROOT = Path(__file__).resolve().parents[3]


def test_device_slugs() -> None:
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_check.device_slug("NVIDIA H200") == "h200"
    assert gpu_check.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_check.device_slug("cpu") == "cpu"
    assert gpu_check.device_slug("Some Card") == "some_card"


def test_missing_data_names_what_to_carry(tmp_path: Path) -> None:
    with pytest.raises(DataMissing, match=r"make gpu-carry.*carry=\[\"bench/wheels\", "
                                          r"\"bench/data\"\]"):
        find_data(tmp_path)


def test_the_device_script_imports_nothing_from_tests() -> None:
    for path in (ROOT / "bench").glob("gpu_check*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "tests" or n.startswith("tests.") for n in names), path
