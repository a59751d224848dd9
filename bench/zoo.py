"""The whole torchvision zoo (issue 45): every classifier through ``dpsweep config --check``
with ``[model] fix = true``, one DP step of our engine, and the same step through Opacus.

For each name of ``torchvision.models.list_models(module=torchvision.models)``, untrained with
10 classes (``bench/zoo_factory/torchvision_zoo.py``, a config's factory), in its own process:

* **size**: the smallest of 32, 64, 96 and 224 pixels (and 299 for Inception-v3) at which the
  network, its BatchNorms fixed as ``fix = true`` fixes them (``trainables.models.fix``), runs a
  forward on two examples in train mode and on one in eval mode (what the check runs);
* **check**: a config naming that factory with ``fix = true`` on scikit-learn's digits as RGB
  images of that size (an ``.npz`` per size), through ``orchestrator.door.check_dict`` with the
  data checked: what ``dpsweep config --check`` runs. *accepted*, *refused* (the one line the
  command prints), or *crashed* (any other exception: the command would print a traceback);
* **step**: up to ``--max-params`` trainable parameters, one step of the ``dpsgd`` method on 8
  training examples, built as a trial builds it (``bench.step_time.method_on``); *stepped* when
  every trainable tensor changed and all are finite;
* **Opacus**: the same bound; ``ModuleValidator.fix`` where Opacus asks for it,
  ``GradSampleModule`` and ``DPOptimizer``, one step on the same batch (same test), first as
  built (*as built*), then with every module's ``inplace`` flag off (*in-place off*).

A model's process runs under an address-space limit (``--memory-gib``, so that a model too big
for this machine fails in its own process instead of waking the kernel's OOM killer) and a
wall-clock limit (``--timeout``); it writes each stage as it finishes, so a model stopped by a
limit keeps what it finished and says where it stopped. Rows are appended to
``bench/results/<name>.jsonl`` one model per line; a re-run skips the models already there
(``--fresh`` starts over, ``--redo`` repeats some). Once every model has a row,
``bench/results/<name>.json`` collects them with the commit, versions and machine, and the table
of ``docs/stock-models.md`` is regenerated (``bench.docgen.zoo``).

Run from the repository root (hours on two cores; ``nohup`` and poll the JSONL):
``.venv/bin/python -m bench.zoo [--models ...] [--max-params N] [--timeout S]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from sklearn.datasets import load_digits
from torch import nn

from bench.docgen import blocks as docgen
from bench.harness import write_results
from bench.step_time import default_series, method_on
from bench.stock_models import error_line
from dpsweep.core.errors import UserInputError
from dpsweep.core.storage import atomic_write_json
from dpsweep.orchestrator import door
from dpsweep.trainables.dp.step import PublicData
from dpsweep.trainables.models.fix import fix_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
FACTORY_DIR = ROOT / "bench" / "zoo_factory"
FACTORY = "torchvision_zoo:build"
#: Where the digits are written at each size (ignored by git; rebuilt when missing).
DATA_DIR = ROOT / "runs" / "zoo_data"
RESULTS = "zoo"
SIZES = (32, 64, 96, 224)
#: Inception-v3's auxiliary head needs 299 pixels in train mode.
INCEPTION_SIZES = (*SIZES, 299)
NUM_CLASSES = 10
DEFAULT_MAX_PARAMS = 25_000_000
DEFAULT_TIMEOUT_S = 240.0
DEFAULT_MEMORY_GIB = 16.0
DEFAULT_THREADS = 2
#: Examples of the DP step (ours and Opacus's).
STEP_BATCH = 8
SEED = 0
#: The digits' split sizes: validation is the smallest that tells 10 classes from chance.
SPLITS = {"train_size": 64, "validation_size": 40, "holdout_size": 16, "test_size": 16,
          "shadow_size": 24}
SPLITS_TOTAL = sum(SPLITS.values())
#: 16 grey levels of scikit-learn's digits, as 0-255 pixels.
PIXEL_SCALE = 255 / 16
POLL_S = 0.5
#: What torch's CPU allocator says when an allocation fails.
NO_MEMORY = "can't allocate memory"
GIB = 1 << 30
KIB_PER_MIB = 1024
#: Stages a model's process goes through, in order (a stopped one names where it stopped).
STAGES = ("build", "size", "check", "step", "opacus_as_built", "opacus_inplace_off")


# ---- the data ---------------------------------------------------------------------------------
def data_path(*, size: int, data_dir: Path, count: int = SPLITS_TOTAL) -> Path:
    return data_dir / f"digits_{size}px_{count}.npz"


def write_digits(*, size: int, data_dir: Path, count: int = SPLITS_TOTAL) -> Path:
    """scikit-learn's first ``count`` digits as ``[N, 3, size, size]`` uint8 images (grey,
    upsampled bilinearly): the same examples at every size."""
    path = data_path(size=size, data_dir=data_dir, count=count)
    if path.is_file():
        return path
    digits = load_digits()
    n = count
    x = torch.from_numpy(digits.images[:n] * PIXEL_SCALE).float()[:, None]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    images = x.clamp(0, 255).round().to(torch.uint8).expand(-1, 3, -1, -1).numpy()
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=data_dir, suffix=".npz", delete=False) as fh:
        np.savez(fh, x=images, y=digits.target[:n].astype(np.int64))
    Path(fh.name).replace(path)
    return path


def config_dict(name: str, size: int, data_dir: Path) -> dict[str, Any]:
    """The config ``dpsweep config --check`` would read for ``name`` at ``size`` pixels."""
    path = data_path(size=size, data_dir=data_dir)
    return {"data": {"dataset": "file", "path": str(path), **SPLITS},
            "model": {"factory": FACTORY, "code_dir": str(FACTORY_DIR),
                      "args": {"name": name}, "fix": True},
            "training": {"epochs": 1, "batch_size": STEP_BATCH},
            "audit": {"enabled": False}}


# ---- one model, in its own process ------------------------------------------------------------
def sizes_for(name: str) -> tuple[int, ...]:
    return INCEPTION_SIZES if name.startswith("inception") else SIZES


def build(name: str) -> nn.Module:
    torch.manual_seed(SEED)
    return torchvision.models.get_model(name, weights=None, num_classes=NUM_CLASSES)


def _trainable(net: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in net.named_parameters() if p.requires_grad]


def find_size(net: nn.Module, sizes: tuple[int, ...]) -> tuple[int | None, dict[str, str]]:
    """The smallest size whose forward runs on two examples (train mode) and one (eval mode),
    and each size tried with what it raised."""
    tried: dict[str, str] = {}
    gen = torch.Generator().manual_seed(SEED)
    for size in sizes:
        try:
            with torch.no_grad():
                net.train()
                net(torch.randn(2, 3, size, size, generator=gen))
                net.eval()
                net(torch.randn(1, 3, size, size, generator=gen))
        except Exception as exc:  # too small for the model: the next size
            tried[str(size)] = error_line(exc)
            continue
        tried[str(size)] = "ok"
        return size, tried
    return None, tried


def check(name: str, size: int, data_dir: Path) -> tuple[Any, dict[str, Any]]:
    """``dpsweep config --check`` in process: the checked setup (None unless accepted) and
    what the command would print."""
    started = time.perf_counter()
    setup = None
    try:
        setup = door.check_dict(config_dict(name, size, data_dir), base_dir=ROOT, data=True)
        info: dict[str, Any] = {"status": "accepted", "layers": setup.num_layers}
    except UserInputError as exc:
        text = f"dpsweep: error: {exc}"
        info = {"status": "refused", "line": text.splitlines()[0],
                "lines": len(text.splitlines())}
    except Exception as exc:  # the command would print a traceback: dpsweep's bug
        info = {"status": "crashed", "line": reason(exc)}
    return setup, {**info, "seconds": time.perf_counter() - started}


def reason(exc: BaseException) -> str:
    """The exception's line; an allocation that failed says so first (torch's own first
    sentence names only the allocator's check)."""
    if isinstance(exc, MemoryError) or NO_MEMORY in str(exc):
        return f"out of memory at the bench's address-space limit: {type(exc).__name__}"
    return error_line(exc)


def moved(net: nn.Module, before: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Trainable tensors changed by the step, out of all, and whether all are finite."""
    now = dict(_trainable(net))
    changed = [n for n, p in now.items() if not torch.equal(before[n], p.detach())]
    finite = all(bool(torch.isfinite(p).all()) for p in now.values())
    unchanged = [n for n in now if n not in changed]
    return {"changed": len(changed), "tensors": len(now), "finite": finite,
            "unchanged": unchanged[:3], "ok": finite and not unchanged}


def our_step(setup: Any) -> dict[str, Any]:
    """One ``dpsgd`` step on the checked config's network, as a trial builds it."""
    started = time.perf_counter()
    try:
        splits = setup.data_splits()
        torch.manual_seed(SEED)
        model = setup.build_network(splits)
        public = PublicData(x=splits.shadow.x, y=splits.shadow.y,
                            generator=torch.Generator().manual_seed(SEED + 1))
        method = method_on(model, default_series("dpsgd"), batch=STEP_BATCH, public=public)
        before = {n: p.detach().clone() for n, p in _trainable(model)}
        method.step(splits.train.x[:STEP_BATCH], splits.train.y[:STEP_BATCH])
        info = {"path": getattr(model, "per_example_path", None), **moved(model, before)}
        info["status"] = "stepped" if info["ok"] else "failed"
    except Exception as exc:  # recorded per model; the bench goes on
        info = {"status": "failed", "reason": reason(exc)}
    return {**info, "seconds": time.perf_counter() - started}


def _opacus_ready(net: nn.Module) -> tuple[nn.Module, list[str]]:
    """``ModuleValidator.fix`` where Opacus says it is needed, and the swaps it made."""
    from opacus.validators import ModuleValidator  # optional for dpsweep itself

    if ModuleValidator.is_valid(net):
        return net, []
    before = {n: type(m).__name__ for n, m in net.named_modules()}
    fixed = ModuleValidator.fix(net)
    swaps: dict[str, int] = {}
    for n, m in fixed.named_modules():
        if n in before and before[n] != type(m).__name__:
            key = f"{before[n]} -> {type(m).__name__}"
            swaps[key] = swaps.get(key, 0) + 1
    return fixed, [f"{k} x {swap}" for swap, k in sorted(swaps.items())]


def opacus_step(name: str, x: torch.Tensor, y: torch.Tensor, *,
                inplace_off: bool) -> dict[str, Any]:
    """One DP-SGD step through Opacus's hooks, as its users run it."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    started = time.perf_counter()
    info: dict[str, Any] = {}
    try:
        net, info["fixed"] = _opacus_ready(build(name))
        if inplace_off:
            info["inplace_switched"] = sum(1 for m in net.modules() if getattr(m, "inplace", False))
            for module in net.modules():
                if getattr(module, "inplace", False):
                    module.inplace = False
        gsm = GradSampleModule(net, batch_first=True, loss_reduction="mean")
        info["functorch"] = [n or "(root)" for n, m in net.named_modules()
                             if hasattr(m, "ft_compute_sample_grad")][:3]
        opt = DPOptimizer(torch.optim.SGD([p for _, p in _trainable(gsm)], lr=0.1),
                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=len(x))
        before = {n: p.detach().clone() for n, p in _trainable(net)}
        gsm.train()
        out = gsm(x)
        logits = out.logits if hasattr(out, "logits") else out  # GoogLeNet / Inception in train
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(logits, y).backward()
        opt.step()
        info.update(moved(net, before))
        info["status"] = "ok" if info["ok"] else "failed"
    except Exception as exc:  # Opacus cannot run this model: recorded, not fatal
        info.update(status="n/a", reason=reason(exc))
    return {**info, "seconds": time.perf_counter() - started}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / KIB_PER_MIB


def _after(row: dict[str, Any], key: str) -> None:
    """Free what the stage left (hooks make cycles) and note the process's peak so far."""
    gc.collect()
    row[key]["peak_rss_mib"] = round(peak_rss_mib())


def run_model(name: str, *, max_params: int, data_dir: Path,
              record: Callable[[dict[str, Any]], None]) -> None:
    """Every stage of one model; ``record`` gets the row so far after each stage."""
    row: dict[str, Any] = {"name": name, "stage": "build"}
    record(row)
    net = build(name)
    row["params"] = sum(p.numel() for _, p in _trainable(net))
    net, _ = fix_model(net)
    row["stage"] = "size"
    record(row)
    size, row["sizes_tried"] = find_size(net, sizes_for(name))
    del net
    row["input"] = size
    row["stage"] = "check"
    record(row)
    setup, row["check"] = check(name, size or sizes_for(name)[-1], data_dir)
    _after(row, "check")
    bounded = row["params"] <= max_params
    skip = {"status": "skipped", "reason": f"{row['params']:,} trainable parameters > "
                                            f"--max-params {max_params:,}"}
    row["stage"] = "step"
    record(row)
    if setup is None:
        row["step"] = {"status": "skipped", "reason": f"check {row['check']['status']}"}
    else:
        row["step"] = our_step(setup) if bounded else skip
        _after(row, "step")
    if size is None:
        row["opacus_as_built"] = row["opacus_inplace_off"] = {
            "status": "skipped", "reason": "no size's forward runs"}
    elif not bounded:
        row["opacus_as_built"] = row["opacus_inplace_off"] = skip
    else:
        gen = torch.Generator().manual_seed(SEED)
        x = torch.randn(STEP_BATCH, 3, size, size, generator=gen)
        y = torch.arange(STEP_BATCH) % NUM_CLASSES
        for key, off in (("opacus_as_built", False), ("opacus_inplace_off", True)):
            row["stage"] = key
            record(row)
            row[key] = opacus_step(name, x, y, inplace_off=off)
            _after(row, key)
    row["stage"] = "done"
    row["peak_rss_mib"] = peak_rss_mib()
    record(row)


def child_main(name: str, *, partial: Path, max_params: int, data_dir: Path, threads: int,
               memory_gib: float) -> None:
    limit = int(memory_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")

    def record(row: dict[str, Any]) -> None:
        atomic_write_json(partial, {**row, "peak_rss_mib": peak_rss_mib()})

    run_model(name, max_params=max_params, data_dir=data_dir, record=record)


# ---- the parent: one process per model, the JSONL, the results --------------------------------
def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int | None, float, float]:
    """(exit status or None when killed at the limit, seconds, the process's peak RSS in MiB)."""
    started = time.perf_counter()
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, time.perf_counter() - started, usage.ru_maxrss / KIB_PER_MIB
        if time.perf_counter() - started > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            return None, time.perf_counter() - started, usage.ru_maxrss / KIB_PER_MIB
        time.sleep(POLL_S)


def run_child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model's row from its own process, whatever became of the process."""
    with tempfile.TemporaryDirectory() as tmp:
        partial, log = Path(tmp) / "row.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, "-m", "bench.zoo", "--one", name, "--partial", str(partial),
               "--max-params", str(args.max_params), "--threads", str(args.threads),
               "--memory-gib", str(args.memory_gib), "--data-dir", str(args.data_dir)]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            rc, seconds, rss = _wait(proc, args.timeout)
        row = json.loads(partial.read_text()) if partial.is_file() else {"name": name}
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    stage = row.get("stage", "start")
    row.update(seconds=round(seconds, 1), peak_rss_mib=round(rss), commit=_commit(),
               limits={"timeout_s": args.timeout, "memory_gib": args.memory_gib,
                       "max_params": args.max_params, "threads": args.threads})
    if rc is None:
        row["stopped"] = f"wall-clock limit {args.timeout:g} s in stage {stage}"
    elif rc != 0:
        row["stopped"] = (f"killed by signal {-rc} in stage {stage}" if rc < 0
                          else f"exit {rc} in stage {stage}: {tail[0][:300]}")
    row["family"] = torchvision.models.get_model_builder(name).__module__.rsplit(".", 1)[-1]
    return row


def read_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The JSONL's rows by model, the last one of a model winning."""
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["name"]: row for row in rows}


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False, timeout=30).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def totals(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    def count(key: str, status: str) -> int:
        return sum(1 for r in rows.values() if (r.get(key) or {}).get("status") == status)

    return {"models": len(rows), "accepted": count("check", "accepted"),
            "refused": count("check", "refused"), "crashed": count("check", "crashed"),
            "stepped": count("step", "stepped"), "opacus_as_built": count("opacus_as_built", "ok"),
            "opacus_inplace_off": count("opacus_inplace_off", "ok"),
            "stopped": sum(1 for r in rows.values() if r.get("stopped"))}


def versions() -> dict[str, Any]:
    """The commit, versions and machine a result was measured with."""
    import opacus

    return {"date": time.strftime("%Y-%m-%d"), "commit": _commit(),
            "torch": torch.__version__, "torchvision": torchvision.__version__,
            "opacus": opacus.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} "
                       "GiB memory"}


def run_info(args: argparse.Namespace) -> dict[str, Any]:
    """What a reader needs to judge the rows: versions, machine, the bench's settings."""
    return {"bench": "bench.zoo", **versions(), "threads": args.threads,
            "max_params": args.max_params, "timeout_s": args.timeout,
            "memory_gib": args.memory_gib, "sizes": list(SIZES),
            "inception_sizes": list(INCEPTION_SIZES), "step_batch": STEP_BATCH,
            "num_classes": NUM_CLASSES, "splits": SPLITS}


def _summary(row: Mapping[str, Any]) -> str:
    def status(key: str) -> str:
        return (row.get(key) or {}).get("status", "-")

    check_line = (row.get("check") or {}).get("line", "")
    stopped = f" STOPPED: {row['stopped']}" if row.get("stopped") else ""
    return (f"{row['name']:<22} {row.get('params', 0):>12,} {row.get('input')!s:>4} px "
            f"check {status('check')}, step {status('step')}, opacus {status('opacus_as_built')}"
            f"/{status('opacus_inplace_off')} ({row['seconds']:.0f} s, "
            f"{row['peak_rss_mib']:.0f} MiB){stopped}"
            f"{' | ' + check_line[:160] if check_line else ''}")


def models_to_run(names: list[str], done: Mapping[str, Any], redo: list[str]) -> Iterator[str]:
    yield from (n for n in names if n not in done or n in redo)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", help="these models only (default: the whole list)")
    ap.add_argument("--max-params", type=int, default=DEFAULT_MAX_PARAMS,
                    help=f"step models up to this many trainable parameters "
                         f"(default {DEFAULT_MAX_PARAMS:,}); larger ones are checked only")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds per model (default {DEFAULT_TIMEOUT_S:g})")
    ap.add_argument("--memory-gib", type=float, default=DEFAULT_MEMORY_GIB,
                    help=f"address-space limit of a model's process (default "
                         f"{DEFAULT_MEMORY_GIB:g})")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    ap.add_argument("--name", default=RESULTS,
                    help=f"results bench/results/NAME.jsonl and .json (default {RESULTS})")
    ap.add_argument("--fresh", action="store_true", help="start the JSONL over")
    ap.add_argument("--redo", nargs="+", default=[], help="run these models again")
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR, help=argparse.SUPPRESS)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--partial", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        child_main(args.one, partial=args.partial, max_params=args.max_params,
                   data_dir=args.data_dir, threads=args.threads, memory_gib=args.memory_gib)
        return
    everything = torchvision.models.list_models(module=torchvision.models)
    names = args.models or everything
    unknown = sorted(set(names) - set(everything))
    if unknown:
        raise SystemExit(f"not torchvision classifiers: {unknown}")
    jsonl = RESULTS_DIR / f"{args.name}.jsonl"
    if args.fresh:
        jsonl.unlink(missing_ok=True)
    for size in sorted({s for n in names for s in sizes_for(n)}):
        write_digits(size=size, data_dir=args.data_dir)
    for name in models_to_run(names, read_rows(jsonl), args.redo):
        row = run_child(name, args)
        with jsonl.open("a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
        print(_summary(row), flush=True)
    rows = read_rows(jsonl)
    missing = [n for n in everything if n not in rows]
    if missing and args.name == RESULTS:  # the committed results hold the whole list
        print(f"{len(rows)} of {len(everything)} models in {jsonl}; missing {missing}")
        return
    ordered = {n: rows[n] for n in (everything if not missing else names) if n in rows}
    payload = {**run_info(args), "models": ordered, "order": list(ordered),
               "totals": totals(ordered),
               "commits": sorted({r.get("commit", "?") for r in ordered.values()}),
               "wall_s": sum(r.get("seconds", 0.0) for r in ordered.values())}
    path = write_results(args.name, payload)
    print(f"wrote {path}: {payload['totals']}")
    if args.name == RESULTS:
        page = docgen.ROOT / docgen.STOCK_DOC
        page.write_text(docgen.render(page.read_text(), "zoo"))
        print(f"regenerated {docgen.STOCK_DOC}")


if __name__ == "__main__":
    main()
