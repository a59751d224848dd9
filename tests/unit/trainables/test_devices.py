"""Where a trial runs: CUDA trains with full float32 (no TF32), so weighted sums and the norms
they were clipped by agree; a device that is not there is refused by name."""

from __future__ import annotations

import pytest
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.training.loop import resolve_device


def test_cuda_turns_tf32_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    previous = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert resolve_device("auto") == torch.device("cuda")
        assert not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(previous)
        torch.backends.cuda.matmul.allow_tf32 = False


def test_a_missing_gpu_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserInputError, match="no CUDA device is visible") as err:
        resolve_device("cuda:0")
    assert err.value.field == "resources.device"
