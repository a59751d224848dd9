"""Where the DP-SGD step's time goes on a GPU: ``torch.profiler`` over the engine step of
``bench.cuda_check`` (operators by device and host time, and the host-device synchronisations).

    python -m bench.cuda_profile [--model cnn28] [--batch 2048] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

from bench import cuda_check
from bench import step_time as st
from trainables.training import full_float32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn28", choices=list(st.CONFIGS))
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda")
    full_float32()
    cfg = dataclasses.replace(st.CONFIGS[args.model], batch=args.batch)
    step = cuda_check._engine_step(cfg, device)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=18))
    print(table.table(sort_by="cpu_time_total", row_limit=18))
    syncs = [e for e in table if "Synchronize" in e.key or "Memcpy DtoH" in e.key
             or e.key in ("aten::item", "aten::_local_scalar_dense")]
    for e in syncs:
        print(f"{e.key}: {e.count / args.steps:.1f} per step")


if __name__ == "__main__":
    main()
