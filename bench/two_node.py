"""A sweep on a real two-node Ray cluster on this machine, through ``--address``.

``ray.cluster_utils.Cluster`` starts a head node and a second node as separate processes (each
with its own raylet and one CPU) on loopback; ``dpsweep run --address`` then drives a small
digits sweep on it, and the trials' records say which node ran each. Prints the node of every
trial and writes bench/results/two_node.json.

    .venv/bin/python -m bench.two_node
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import write_results

CONFIG = """
[training]
epochs = 3
[sweep]
methods = ["dpsgd", "auto_s"]
trials_per_method = 3
max_concurrent_trials = 2
baseline = false
[audit]
enabled = false
"""


def main() -> None:
    import secrets

    from ray.cluster_utils import Cluster

    from dpsweep.orchestrator.cluster import connection as dpcluster
    from dpsweep.orchestrator.raytemp import private_temp_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        env_before = dict(os.environ)
        token_env = {dpcluster.AUTH_MODE_ENV: "token",
                     dpcluster.AUTH_TOKEN_ENV: secrets.token_hex(32)}
        os.environ.update(token_env)
        # Ray's cluster_utils writes the head's address to <RAY_TMPDIR>/ray/ray_current_cluster
        # whatever temp_dir the nodes get; this run's own directory keeps that out of /tmp/ray.
        (root / "ray").mkdir()
        os.environ["RAY_TMPDIR"] = str(root)
        dpcluster._refresh_ray_auth_config()
        loopback = {"node_ip_address": dpcluster.LOOPBACK_V4,
                    "temp_dir": str(private_temp_dir())}
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **loopback},
                        shutdown_at_exit=True)
        try:
            nodes.add_node(num_cpus=1, **loopback)
            nodes.wait_for_nodes()
            (root / "sweep.toml").write_text(CONFIG)
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "dpsweep.orchestrator.cli", "run", str(root / "sweep.toml"),
                 "--out", str(root / "run"), "--address", nodes.address, "--quiet"],
                capture_output=True, text=True, env={**os.environ, **token_env}, timeout=900)
            wall = time.perf_counter() - start
            print(proc.stdout[-2000:], proc.stderr[-2000:])
            records = [json.loads(p.read_text())
                       for p in sorted((root / "run").glob("trials/*/result.json"))]
        finally:
            nodes.shutdown()
            os.environ.clear()
            os.environ.update(env_before)
    by_node: dict[str, list[str]] = {}
    for r in records:
        by_node.setdefault(str(r.get("node")), []).append(r["trial_id"])
    for node, trials in by_node.items():
        print(f"node {node[:12]}: {len(trials)} trials: {', '.join(trials)}")
    write_results("two_node", {"exit_code": proc.returncode, "trials_by_node": by_node,
                               "nodes_used": len(by_node), "sweep_wall_s": wall,
                               "config": CONFIG.strip()})
    if proc.returncode != 0 or len(by_node) < 2:
        raise SystemExit("the sweep did not run on both nodes")


if __name__ == "__main__":
    main()
