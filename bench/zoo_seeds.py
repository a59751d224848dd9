"""The seeds' models at their sizes on this machine (issue 45): VGG-16, ViT-B/16 and ResNet-50,
untrained with 10 classes and ``[model] fix = true``, through ``dpsweep config --check`` and a
one-epoch ``dpsweep train`` on 32 x 32 digits, each command in a fresh process whose wall time
and peak resident memory (``wait4``'s ``ru_maxrss``) are recorded.

The seeds' experiments train VGG-16 and ViT-B/16; ResNet-50 is the common middle size. ViT-B/16
takes ``image_size = 32`` through ``[model] args`` (torchvision's ``vit_b_16(image_size=...)``:
4 patches of 16 pixels); the zoo (``bench.zoo``) checks it at its 224. The data are
scikit-learn's digits as 3 x 32 x 32 images (``bench.zoo.write_digits``): 256 training examples,
so one epoch at batch 32 is 8 DP-SGD steps (Poisson sampling, q = 1/8).

Writes ``bench/results/zoo_seeds.json`` (its table is in ``docs/stock-models.md``). Run from
the repository root: ``.venv/bin/python -m bench.zoo_seeds [--models vgg16 ...]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tomli_w
import torchvision

from bench.harness import load_average, write_results
from bench.zoo import (
    DATA_DIR,
    FACTORY,
    FACTORY_DIR,
    GIB,
    NUM_CLASSES,
    ROOT,
    versions,
    write_digits,
)

RESULTS = "zoo_seeds"
#: name -> torchvision builder arguments beyond ``num_classes``.
SEEDS = {"vgg16": {}, "vit_b_16": {"image_size": 32}, "resnet50": {}}
SIZE = 32
SPLITS = {"train_size": 256, "validation_size": 128, "holdout_size": 128, "test_size": 128,
          "shadow_size": 128}
BATCH = 32
EPOCHS = 1
#: The machine's memory the seeds must stay within.
MEMORY_BUDGET_GIB = 24
WORK = ROOT / "runs" / "zoo_seeds"
#: The command of the environment running this bench.
DPSWEEP = Path(sys.executable).parent / "dpsweep"
#: Output lines kept per command (the summary a reader checks against the table).
KEPT_LINES = 4
#: ``train``'s summary: "... sigma 1.0330, q 0.125, steps 8".
STEPS = re.compile(r"\bsteps (\d+)\b")


def write_config(name: str, args: dict[str, Any]) -> Path:
    data = write_digits(size=SIZE, data_dir=DATA_DIR, count=sum(SPLITS.values()))
    config = {"data": {"dataset": "file", "path": str(data), **SPLITS},
              "model": {"factory": FACTORY, "code_dir": str(FACTORY_DIR),
                        "args": {"name": name, **args}, "fix": True},
              "training": {"epochs": EPOCHS, "batch_size": BATCH},
              "audit": {"enabled": False}}
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / f"{name}.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def measured(cmd: list[str]) -> dict[str, Any]:
    """Run ``cmd``: exit status, wall seconds, peak RSS (GiB), its output lines (``lines``)
    and the last few of them."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in output.splitlines() if line.strip()]
    return {"command": " ".join(Path(c).name if c == str(DPSWEEP) else c for c in cmd),
            "rc": proc.returncode, "wall_s": round(time.perf_counter() - started, 1),
            "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 2),
            "last_lines": lines[-KEPT_LINES:], "lines": lines}


def epoch_line(lines: list[str]) -> dict[str, float] | None:
    """The first epoch's row of ``train``'s table (val acc, test acc, eps spent, seconds) and
    the DP steps its summary counts."""
    steps = [int(m.group(1)) for line in lines if (m := STEPS.search(line))]
    for line in lines:
        cells = line.split()
        if len(cells) == 6 and cells[0] == "1":
            _, val, test, _, eps, sec = (float(c) for c in cells)
            return {"val_acc": val, "test_acc": test, "eps_spent": eps, "epoch_s": sec,
                    "steps": steps[-1] if steps else None}
    return None


def seed_row(name: str, args: dict[str, Any]) -> dict[str, Any]:
    config = write_config(name, args)
    out = WORK / name
    shutil.rmtree(out, ignore_errors=True)
    load = [load_average()]
    check = measured([str(DPSWEEP), "config", "--check", str(config)])
    train = measured([str(DPSWEEP), "train", str(config), "--out", str(out)])
    load.append(load_average())
    check.pop("lines")
    train["epoch"] = epoch_line(train.pop("lines"))
    net = torchvision.models.get_model(name, weights=None, num_classes=NUM_CLASSES, **args)
    row = {"args": args, "input": f"3 x {SIZE} x {SIZE}", "check": check, "train": train,
           "params": sum(p.numel() for p in net.parameters() if p.requires_grad),
           "load_average_before_after": load}
    print(f"{name}: check rc {check['rc']} {check['wall_s']} s {check['peak_rss_gib']} GiB; "
          f"train rc {train['rc']} {train['wall_s']} s {train['peak_rss_gib']} GiB "
          f"{train['epoch']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo_seeds",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(SEEDS), default=list(SEEDS))
    args = ap.parse_args(argv)
    rows = {name: seed_row(name, SEEDS[name]) for name in args.models}
    payload = {**versions(), "bench": "bench.zoo_seeds",
               "splits": SPLITS, "batch": BATCH, "epochs": EPOCHS,
               "memory_budget_gib": MEMORY_BUDGET_GIB, "models": rows}
    print(f"wrote {write_results(RESULTS, payload)}")


if __name__ == "__main__":
    main()
