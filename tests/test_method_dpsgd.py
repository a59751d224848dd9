"""DP-SGD through the conformance suite, plus what is specific to it."""

from __future__ import annotations

import torch

from tests.conformance import SoundMethodConformance


class TestDPSGD(SoundMethodConformance):
    method = "dpsgd"

    def test_flat_clipping_matches_the_definition(self) -> None:
        step = self.make_step(clip_norm=1.0)
        norms = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.3, 0.4, 0.0, 0.0]])
        coef = step.clip_coefficients(norms)
        assert torch.allclose(coef[0], torch.full((4,), 0.2), atol=1e-6)  # 1/5
        assert torch.allclose(coef[1], torch.ones(4))  # norm 0.5 < C: untouched
