"""``resources.device = 'cuda'`` is checked against the machine or the cluster that runs the
trials (``orchestrator.cluster.resources.check_device``): no GPU there, or no GPU share per
trial (Ray hides every GPU from a trial that asks for none), is refused before Ray starts."""

from __future__ import annotations

import pytest

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.cluster import resources


def _cluster(*gpus: float) -> resources.ClusterInfo:
    nodes = tuple(resources.NodeResources(f"n{i}", f"10.0.0.{i}", cpus=8, gpus=g,
                                          memory_mb=16000) for i, g in enumerate(gpus))
    return resources.ClusterInfo(address="10.0.0.0:6379", local=False, token_auth=True,
                                 nodes=nodes, session_dir="/nonexistent")


def test_cuda_where_no_node_has_a_gpu_names_the_device() -> None:
    with pytest.raises(UserInputError) as err:
        resources.check_device(device="cuda", gpus_per_trial=1.0, info=_cluster(0, 0))
    assert err.value.field == "resources.device"
    assert "'cpu' or 'auto': this cluster has no GPU" in str(err.value)


def test_cuda_without_a_gpu_share_names_the_share() -> None:
    with pytest.raises(UserInputError) as err:
        resources.check_device(device="cuda", gpus_per_trial=0.0, info=_cluster(0, 2))
    assert err.value.field == "resources.gpus_per_trial"
    assert "> 0 when resources.device = 'cuda'" in str(err.value)


def test_this_machine_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(UserInputError) as err:
        resources.check_device(device="cuda", gpus_per_trial=0.0, info=None)
    assert err.value.field == "resources.device" and "this machine has no GPU" in str(err.value)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_other_devices_ask_for_nothing(device: str) -> None:
    resources.check_device(device=device, gpus_per_trial=0.0, info=_cluster(0))
    resources.check_device(device="cuda", gpus_per_trial=0.25, info=_cluster(0, 1))
