"""The raylet's error lines (a worker that died) stay off the user's terminal: dpsweep records
each trial's failure with its reason; anything else Ray prints to the driver still shows."""

from __future__ import annotations

import logging

import pytest

ray_worker = pytest.importorskip("ray._private.worker")


def test_raylet_lines_go_to_the_log_and_others_pass(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from dpsweep.orchestrator.cluster import connection as cluster

    seen: list[dict] = []
    monkeypatch.setattr(ray_worker, "print_to_stdstream",
                        lambda data, ignore_prefix=False: seen.append(data))
    cluster._route_raylet_messages()
    cluster._route_raylet_messages()  # twice: still one layer
    with caplog.at_level(logging.INFO, logger="dpsweep.cluster"):
        ray_worker.print_to_stdstream({"pid": "raylet", "lines": ["A worker died"],
                                       "is_err": False})
        ray_worker.print_to_stdstream({"pid": 4242, "lines": ["a task's own print"],
                                       "is_err": False})
    assert [d["pid"] for d in seen] == [4242]
    assert "raylet: A worker died" in caplog.text
    assert capsys.readouterr().err == ""
