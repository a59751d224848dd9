"""DP-SGD-LF through the conformance suite, plus freezing itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.errors import UserInputError
from tests.conformance import SoundMethodConformance
from trainables.training import load_checkpoint_state, train_trial


class TestDPSGDLF(SoundMethodConformance):
    method = "dpsgd_lf"
    method_params = {"t_f_fraction": 0.5, "m_f": 0}

    def test_frozen_layers_bit_identical_after_t_f(self, tmp_path: Path) -> None:
        spec = self.spec(epochs=2)  # 20 steps, t_f = 10 = end of epoch 1
        result = train_trial(spec, checkpoint_root=tmp_path)
        record = result.privacy["method_record"]
        assert record == {"t_f": 10, "t_f_fraction": 0.5, "m_f": 2,
                          "frozen_layers": ["conv1", "conv2"]}
        at_tf = load_checkpoint_state(tmp_path / "epoch_001")["model"]
        end = load_checkpoint_state(tmp_path / "epoch_002")["model"]
        for name in at_tf:
            same = torch.equal(at_tf[name], end[name])
            if name.startswith(("blocks.conv1.", "blocks.conv2.")):
                assert same, f"{name} moved after t_f"
            else:
                assert not same, f"{name} should still train"
        assert [m["frozen_layers"] for m in result.history] == [2.0, 2.0]
        # the ledger still shows sigma at every step: freezing changes no accounting
        assert result.privacy["ledger"]["events"][0]["count"] == 20

    def test_frozen_layers_get_no_noise_and_no_gradient(self) -> None:
        step = self.make_step(clip_norm=1.0, sigma=2.0)
        step.step_count = step.t_f  # frozen from here
        assert step.trainable_layers() == [False, False, True, True]
        assert step.noise_std() == [0.0, 0.0, 2.0, 2.0]
        x = torch.randn(5, 1, 8, 8)
        grads = step.per_example_grads(x, torch.arange(5))
        assert not any(n.startswith(("blocks.conv1.", "blocks.conv2.")) for n in grads.grads)
        assert torch.all(grads.norms[:, :2] == 0)
        assert step.whitened_noise_multiplier() == pytest.approx(2.0)

    @pytest.mark.parametrize(("params", "field"), [
        ({"m_f": 4}, "method_params.m_f"),
        ({"m_f": -1}, "method_params.m_f"),
        ({"t_f_fraction": 1.5}, "method_params.t_f_fraction"),
        ({"freeze": 2}, "method_params.freeze"),
    ])
    def test_bad_params(self, params: dict, field: str) -> None:
        with pytest.raises(UserInputError) as exc:
            self.make_step(params=params)
        assert exc.value.field == field
