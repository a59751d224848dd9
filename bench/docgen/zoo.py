"""Generated tables of docs/stock-models.md for the whole torchvision zoo (issue 45): per family
and per model, whether ``dpsweep config --check`` accepts it with ``[model] fix = true``, whether
one DP step of our engine runs, and whether Opacus's does, as built and with in-place flags off.

Built from the committed ``bench/results/zoo.json`` (``bench.zoo``); every refusal, failure and
limit is given in a note under the table, in the words the run recorded. ``bench.docgen`` owns
the block and checks it; this module only formats.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.docgen.runs import load_results, missing_results

ZOO = "zoo"
SEEDS = "zoo_seeds"
#: ViT-B/16 at its own 224 pixels through ``bench.zoo`` with a bound above its parameters.
VIT_224 = "zoo_vit224"
VIT_224_COMMAND = ("python -m bench.zoo --name zoo_vit224 --models vit_b_16 --max-params "
                   "100000000 --timeout 900")
#: (row key, column title) of the step columns, in the table's order.
STEPS = (("step", "dpsweep step"), ("opacus_as_built", "Opacus as built"),
         ("opacus_inplace_off", "Opacus in-place off"))
#: What a step's status reads as in a cell.
STEP_CELLS = {"stepped": "yes", "ok": "yes", "failed": "**no**", "n/a": "no"}
MILLION = 1e6
#: How ``bench.zoo`` words an allocation refused by its address-space limit.
OUT_OF_MEMORY = "out of memory"


class _Notes:
    """Numbered notes under the table, one per distinct text."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"- [{i}] {_escape(t)}" for i, t in enumerate(self.texts, 1)]


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _status(row: Mapping[str, Any], key: str) -> str:
    return (row.get(key) or {}).get("status", "")


def _check_cell(row: Mapping[str, Any], notes: _Notes) -> str:
    check = row.get("check")
    if check is None:
        return "not reached " + notes.mark(row.get("stopped", "no result"))
    if check["status"] == "accepted":
        return "accepted"
    return f"**{check['status']}** " + notes.mark(check["line"])


def _step_cell(row: Mapping[str, Any], key: str, notes: _Notes) -> str:
    step = row.get(key)
    if step is None:
        return "not reached " + notes.mark(row.get("stopped", "no result")) if "check" in row \
            else "-"
    if step["status"] == "skipped":
        return "-"
    cell = STEP_CELLS.get(step["status"], step["status"])
    if step.get("reason", "").startswith(OUT_OF_MEMORY):  # the bench's limit, not a failure
        limit = row.get("limits", {}).get("memory_gib")
        return "out of memory " + notes.mark(step["reason"] + (f" ({limit:g} GiB)" if limit
                                                               else ""))
    if step.get("reason"):
        return f"{cell} " + notes.mark(step["reason"])
    if step["status"] == "failed":  # ran, but left a tensor unchanged or not finite
        return f"{cell} " + notes.mark(f"{step['changed']} of {step['tensors']} trainable "
                                       f"tensors changed (unchanged: {step['unchanged']}), "
                                       f"finite: {step['finite']}")
    return cell


def family_table(run: Mapping[str, Any]) -> str:
    """Per torchvision module: how many models pass each stage."""
    families: dict[str, list[Mapping[str, Any]]] = {}
    for name in run["order"]:
        row = run["models"][name]
        families.setdefault(row["family"], []).append(row)
    lines = ["| family | models | accepted | stepped (of bounded) | Opacus as built | "
             "Opacus in-place off |", "|---|---|---|---|---|---|"]
    for family, rows in sorted(families.items()):
        bounded = sum(1 for r in rows if r.get("params", 0) <= run["max_params"])
        lines.append(
            f"| `{family}` | {len(rows)} | "
            f"{sum(_status(r, 'check') == 'accepted' for r in rows)} | "
            f"{sum(_status(r, 'step') == 'stepped' for r in rows)} of {bounded} | "
            f"{sum(_status(r, 'opacus_as_built') == 'ok' for r in rows)} | "
            f"{sum(_status(r, 'opacus_inplace_off') == 'ok' for r in rows)} |")
    return "\n".join(lines)


def model_table(run: Mapping[str, Any], notes: _Notes) -> str:
    lines = ["| model | family | trainable parameters | input | check | per-example path | "
             + " | ".join(title for _, title in STEPS) + " | seconds | peak RSS |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted((run["models"][n] for n in run["order"]), key=lambda r: r["family"])
    for row in rows:
        size = row.get("input")
        cells = [f"`{row['name']}`", row["family"],
                 f"{row['params'] / MILLION:.1f}M" if "params" in row else "-",
                 f"{size} px" if size else "none " + notes.mark(
                     "no size's forward runs: " + "; ".join(
                         f"{k} px: {v}" for k, v in row.get("sizes_tried", {}).items())),
                 _check_cell(row, notes), (row.get("step") or {}).get("path") or "-"]
        cells += [_step_cell(row, key, notes) for key, _ in STEPS]
        stopped = f" {notes.mark(row['stopped'])}" if row.get("stopped") else ""
        cells += [f"{row['seconds']:.0f}{stopped}", f"{row['peak_rss_mib'] / 1024:.1f} GiB"]
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def _limit(run: Mapping[str, Any], key: str) -> str:
    """The rows' limit: one value, or the range when some rows were run again with another."""
    values = sorted({r.get("limits", {}).get(key, run[key]) for r in run["models"].values()})
    return f"{values[0]:g}" if len(values) == 1 else f"{values[0]:g}-{values[-1]:g}"


def zoo_table() -> str:
    run = load_results(ZOO)
    if run is None:
        return missing_results(ZOO, "zoo")
    t = run["totals"]
    bounded = sum(1 for r in run["models"].values() if r.get("params", 0) <= run["max_params"])
    head = (f"{run['date']}, commit `{'`, `'.join(run['commits'])}`; torch {run['torch']}, "
            f"torchvision {run['torchvision']}, Opacus {run['opacus']}; {run['machine']}, "
            f"{run['threads']} torch threads; per model at most {_limit(run, 'timeout_s')} s "
            f"and {_limit(run, 'memory_gib')} GiB of address space; steps up to "
            f"{run['max_params'] / MILLION:g}M trainable parameters on {run['step_batch']} "
            f"examples; whole run {run['wall_s'] / 60:.0f} min (`bench/results/{ZOO}.json`).")
    total = (f"**accepted {t['accepted']}/{t['models']}** (refused {t['refused']}, crashed "
             f"{t['crashed']}); **stepped {t['stepped']}** of the {bounded} models up to "
             f"{run['max_params'] / MILLION:g}M parameters; **Opacus as built "
             f"{t['opacus_as_built']}, Opacus in-place off {t['opacus_inplace_off']}** of the "
             f"same {bounded}; stopped by a limit: {t['stopped']}.")
    notes = _Notes()
    table = model_table(run, notes)
    return "\n".join([head, "", total, "", family_table(run), "", table, "", *notes.lines()])




def seeds_table() -> str:
    """The seeds' models at their sizes: the check and a one-epoch train, time and memory."""
    run = load_results(SEEDS)
    if run is None:
        return missing_results(SEEDS, "zoo_seeds")
    lines = ["| model | `[model] args` | trainable parameters | check: exit, wall, peak RSS | "
             "one-epoch train: exit, wall, peak RSS | the epoch: DP steps, seconds | "
             "val / test acc | epsilon spent |", "|---|---|---|---|---|---|---|---|"]
    for name, row in run["models"].items():
        check, train, epoch = row["check"], row["train"], row["train"].get("epoch") or {}
        args = ", ".join(f"{k} = {v}" for k, v in {"name": name, **row["args"]}.items())
        lines.append(
            f"| `{name}` | `{args}` | {row['params'] / MILLION:.1f}M | {check['rc']}, "
            f"{check['wall_s']:.0f} s, {check['peak_rss_gib']:.1f} GiB | {train['rc']}, "
            f"{train['wall_s']:.0f} s, {train['peak_rss_gib']:.1f} GiB | "
            + (f"{epoch['steps']}, {epoch['epoch_s']:.1f} s | {epoch['val_acc']:.3f} / "
               f"{epoch['test_acc']:.3f} | {epoch['eps_spent']:.3f} |" if epoch
               else "- | - | - |"))
    peak = max(max(r["check"]["peak_rss_gib"], r["train"]["peak_rss_gib"])
               for r in run["models"].values())
    loads = [x for r in run["models"].values() for x in r["load_average_before_after"]]
    s = run["splits"]
    return (f"{run['date']}, commit `{run['commit']}`; torch {run['torch']}, torchvision "
            f"{run['torchvision']}; {run['machine']}; 1-minute load average "
            f"{min(loads):.1f}-{max(loads):.1f}; digits as 3 x 32 x 32 images, "
            f"{s['train_size']} training examples, {run['epochs']} epoch at batch "
            f"{run['batch']}, `dpsgd` at its defaults, audit off "
            f"(`bench/results/{SEEDS}.json`). Largest peak: {peak:.1f} GiB of the "
            f"{run['memory_budget_gib']} GiB budget.\n\n" + "\n".join(lines) + vit_224_line())


def vit_224_line() -> str:
    """ViT-B/16 at 224 pixels: the check and one step (ours, Opacus's), time and peak RSS."""
    run = load_results(VIT_224)
    if run is None:
        return ""
    row = run["models"]["vit_b_16"]

    def stage(key: str, what: str) -> str:
        s = row[key]
        return (f"{what}: {s['status']}, {s['seconds']:.0f} s, the process's peak RSS so far "
                f"{s['peak_rss_mib'] / 1024:.1f} GiB")

    parts = [stage("check", "the check"), stage("step", f"one `dpsgd` step on "
                                                       f"{run['step_batch']} examples"),
             stage("opacus_as_built", "Opacus's step as built")]
    return (f"\n\nViT-B/16 at its own {row['input']} pixels (`{VIT_224_COMMAND}`, "
            f"{run['date']}, commit `{row['commit']}`, {run['threads']} torch "
            f"threads, `bench/results/{VIT_224}.json`): " + "; ".join(parts) + ".")


GENERATORS = {"zoo": zoo_table, "zoo_seeds": seeds_table}
