"""``dpsweep run --estimate``'s arithmetic (``orchestrator.sweep.estimate``): measured per-trial
costs multiplied out and spread over the trials that run at once. The measurement itself, against
a real sweep, is ``tests/system/test_progress_estimate.py``."""

from __future__ import annotations

import pytest

from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.sweep.estimate import FIXED_SECONDS, Estimate, Extras, SeriesCost


def test_trials_steps_and_audits_multiply_out_over_the_concurrency() -> None:
    cost = SeriesCost(series="dpsgd", trials=3, steps=100, step_s=0.01, setup_s=2.0,
                      eval_s=0.5, epochs=4, references=8, reference_steps=50,
                      reference_step_s=0.02, scoring_s=3.0)
    assert cost.train_seconds() == pytest.approx(2.0 + 1.0 + 2.0)
    assert cost.audit_seconds() == pytest.approx(8 * 50 * 0.02 + 3.0)
    audited = Estimate(series=(cost,), width=2, audited=True, peak_bytes=2**30,
                       peak_what="RSS", device="CPU")
    assert audited.trial_seconds() == pytest.approx(3 * (5.0 + 11.0))
    assert audited.wall_seconds() == pytest.approx(FIXED_SECONDS + 48.0 / 2)
    plain = Estimate(series=(cost,), width=1, audited=False, peak_bytes=2**30,
                     peak_what="RSS", device="CPU")
    assert plain.trial_seconds() == pytest.approx(15.0)
    text = "\n".join(audited.lines())
    assert "3 trials, 300 DP steps, 24 audit references" in text
    assert "peak memory per trial: 1024 MiB (RSS)" in text
    assert "audit" not in "\n".join(plain.lines()[1:2])


def test_the_baseline_and_the_jobs_after_the_search_are_projected_and_named() -> None:
    """The baseline is one more trial of the first series; after the search each study's
    front of one trial is re-run ``seeds`` times and, with the audit after the search,
    audited; those jobs never take less than the longest."""
    cost = SeriesCost(series="dpsgd", trials=3, steps=100, step_s=0.01, setup_s=2.0,
                      eval_s=0.5, epochs=4, references=8, reference_steps=50,
                      reference_step_s=0.02, scoring_s=3.0)  # train 5 s, audit 11 s
    after = Estimate(series=(cost,), width=2, audited=False, peak_bytes=2**30,
                     peak_what="RSS", device="CPU", studies=(2,),
                     extras=Extras(baseline=True, seeds=1, front_audits=True,
                                   baseline_audited=True))
    assert after.baseline_seconds() == pytest.approx(5.0 + 11.0)
    assert sorted(after.after_jobs()) == pytest.approx([5.0, 5.0, 11.0, 11.0])
    assert after.wall_seconds() == pytest.approx(FIXED_SECONDS + (15.0 + 16.0) / 2 + 32.0 / 2)
    text = "\n".join(after.lines())
    assert "non-private baseline (sweep.baseline): 16.0s" in text
    assert "after the search: 2 re-run(s) (sweep.seeds = 1), 2 front audit(s)" in text
    one = Estimate(series=(cost,), width=4, audited=True, peak_bytes=2**30, peak_what="RSS",
                   device="CPU", extras=Extras(seeds=1, reruns_audited=True))
    assert one.baseline_seconds() == 0.0
    assert one.after_seconds() == pytest.approx(16.0)  # one re-run: not a quarter of it
    assert "after the search: no jobs" in "\n".join(Estimate(
        series=(cost,), width=1, audited=True, peak_bytes=0, peak_what="RSS",
        device="CPU").lines())


def test_config_check_estimates_on_request(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``config --check CONFIG --estimate`` measures the sweep as ``run --estimate`` does and
    writes nothing beside the config."""
    config = tmp_path / "sweep.toml"
    config.write_text("[training]\nepochs = 1\nbatch_size = 50\n[sweep]\nmethods = ['dpsgd']\n"
                      "trials_per_method = 2\n[audit]\nenabled = false\n")
    assert main(["config", "--check", str(config)]) == 0
    assert "projected wall time" not in capsys.readouterr().out
    assert main(["config", "--check", str(config), "--estimate"]) == 0
    out = capsys.readouterr().out
    assert "dpsgd: 2 trial(s) x 10 DP steps" in out and "projected wall time" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.toml"]
