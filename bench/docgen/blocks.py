"""Generated documentation: every table of README.md and docs/ that states a fact of the code
or a measured figure.

The tables come from the methods' declarations (``trainables/methods/``), the search spaces as
sweeps build them (``search_spaces.build_space``, ``search_spaces.searched_params``), the
config's declarations (``orchestrator/config/``), the built-in datasets' sizes, the results
schema (``reports/store.py``) and the committed benchmark results (``bench/results/*.json``,
written by the ``bench`` modules; the whole-run tables are formatted in
``bench.docgen.runs``), so they cannot drift from the code or the measurements:
``python -m bench.docgen`` rewrites the marked blocks, and a test fails when a committed
file differs from what this module generates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from bench.docgen import audit, privacy, runs, zoo
from dpsweep.core.datasets import DATASET_NAMES, INPUT_SHAPES, POOLS
from dpsweep.core.modes import INVALID_TAG
from dpsweep.core.vocabulary import SPLIT_NAMES
from dpsweep.orchestrator.config import SECTIONS, field_param
from dpsweep.orchestrator.sweep.commands import DEMO_SIZES
from dpsweep.reports.store import COLUMNS
from dpsweep.search_spaces import SPACES, STEP, build_space, searched_params
from dpsweep.trainables.data.splits import DEFAULT_SIZES
from dpsweep.trainables.methods import METHODS

ROOT = Path(__file__).resolve().parents[2]
#: (file, block name) pairs this module owns.
BLOCKS = (("README.md", "methods"), ("README.md", "fmnist_headline"),
          ("docs/methods.md", "methods"), ("docs/methods.md", "hyperparameters"),
          ("docs/results.md", "columns"), ("docs/stock-models.md", "stock_speed"),
          ("docs/config.md", "config"), ("docs/config.md", "datasets"),
          ("docs/studies.md", "fmnist_full"), ("docs/studies.md", "fmnist_parts"),
          ("docs/studies.md", "fmnist_details"), ("docs/benchmarks.md", "step_time"),
          ("docs/benchmarks.md", "methods_time"), ("docs/benchmarks.md", "gpu_steps"),
          ("docs/benchmarks.md", "gpu_trials"), ("docs/benchmarks.md", "epoch_time"),
          ("docs/benchmarks.md", "canary_digits"), ("docs/search.md", "search_ranges"),
          ("docs/benchmarks.md", "accounting_time"), ("docs/benchmarks.md", "demo_phases"),
          ("docs/benchmarks.md", "sweep_overhead"), ("docs/benchmarks.md", "cluster_and_faults"),
          ("docs/privacy.md", "overclip"), ("docs/privacy.md", "versus_certified"),
          ("docs/privacy.md", "secure_cost"), ("docs/audit.md", "audit_cost"),
          ("docs/audit.md", "audit_strength"), ("docs/audit.md", "frozen_run"),
          ("docs/operations.md", "chaos"), ("docs/stock-models.md", "zoo"),
          ("docs/stock-models.md", "zoo_seeds"))
#: The stock models' speed table: its page and the results it is generated from.
STOCK_DOC = "docs/stock-models.md"
STOCK_RESULTS = "bench/results/step_time_stock.json"
#: The committed benchmark results the other tables are generated from.
RESULTS = "bench/results"
#: The full-size Fashion-MNIST study: its parts combined (``bench.fmnist_study --combine``) and
#: the published hyperparameters run on the same setting (a part of its own).
FMNIST_FULL = "fmnist_full"
FMNIST_PUBLISHED = "fmnist_full_published"
#: The CPU step-time run and its re-check on a second fresh clone (``bench.step_time``).
STEP_TIME = ("step_time_fresh", "step_time_recheck")
#: The GPU step tables, one per device (``bench.gpu_check`` measures the same table into
#: ``gpu_check_<device>.json``).
GPU_STEPS = ("cuda_check", "cuda_check_h100")
#: Full-size trials trained on a GPU (``bench.cuda_fmnist``).
GPU_TRIALS = ("cuda_fmnist_h100", "cuda_eps1_dpsgd_at_lf_leader", "cuda_eps1_lf_at_dpsgd_leader",
              "cuda_eps3_dpsgd_at_dpsgd_leader", "cuda_eps3_dpsgd_at_lf_leader",
              "cuda_eps3_lf_at_dpsgd_leader", "cuda_eps3_lf_at_lf_leader")
#: A full-size epoch against steps x step time (``bench.epoch_time``): evaluating the test
#: split after the last epoch only, and after every epoch.
EPOCH_TIME = ("epoch_time", "epoch_time_before")
CANARY_DIGITS = "canary_digits"
#: The layer count the search-range table is built for: a range that follows the model
#: (dpsgd_lf's m_f) is shown for the four layers of the digits and Fashion-MNIST CNNs.
RANGE_TABLE_LAYERS = 4


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def methods_table() -> str:
    lines = ["| method | what it does | modes (epsilon claim) | source |", "|---|---|---|---|"]
    for name, cls in sorted(METHODS.items()):
        modes = ", ".join(f"`{m.name}` ({'valid' if m.dp_valid else INVALID_TAG})"
                          for m in cls.modes)
        lines.append(f"| `{name}` | {_escape(cls.summary)} | {modes} | "
                     f"{_escape(cls.citation or 'baseline')} |")
    return "\n".join(lines)


def hyperparameter_tables() -> str:
    out = []
    for name, cls in sorted(METHODS.items()):
        searched = searched_params(name) if name in SPACES else frozenset()
        out += [f"### `{name}`", "", _escape(cls.argument), "",
                "| parameter | default | allowed | scale | modes | presets | searched | meaning |",
                "|---|---|---|---|---|---|---|---|"]
        for row in cls.declaration().table():
            out.append(" | ".join([
                f"| `{row['name']}`", f"`{row['default']}`", _escape(row["allowed"]),
                row["log"] or "linear", row["modes"], _escape(row["presets"]) or "-",
                "yes" if row["name"] in searched else "",
                _escape(row["doc"]) + " |"]))
        out.append("")
    return "\n".join(out).rstrip()


def _range_text(dist: Any) -> tuple[str, str]:
    """(range, scale) of one Optuna distribution as a sweep builds it."""
    if hasattr(dist, "choices"):
        return "one of " + ", ".join(f"{c:g}" for c in dist.choices), "grid"
    return f"{dist.low:g} to {dist.high:g}", "log" if dist.log else "linear"


def search_ranges_table() -> str:
    """Every method's search ranges as a sweep builds them (``build_space`` in each mode), before
    a config's ``[search.*]`` overrides: the one place docs/ states them."""
    lines = ["| method | searched | range | scale | modes |", "|---|---|---|---|---|"]
    for name in sorted(SPACES):
        modes = [m.name for m in METHODS[name].modes]
        per_model = SPACES[name].per_model
        follows = set(per_model(RANGE_TABLE_LAYERS)) if per_model is not None else set()
        rows: dict[str, tuple[str, str, list[str]]] = {}
        for mode in modes:
            built = build_space(name, mode=mode, num_layers=RANGE_TABLE_LAYERS)
            for key, dist in built.distributions.items():
                text, scale = _range_text(dist)
                rows.setdefault(key, (text, scale, []))[2].append(mode)
        for key, (text, scale, where) in rows.items():
            label = f"`{key}`" + (" (lr = lr_x_clip / clip_norm)" if key == STEP else "")
            if key in follows:
                text += f" at {RANGE_TABLE_LAYERS} layers (follows the model)"
            read = "all" if len(where) == len(modes) else ", ".join(f"`{m}`" for m in where)
            lines.append(f"| `{name}` | {label} | {text} | {scale} | {read} |")
    return "\n".join(lines)


def columns_table() -> str:
    lines = ["| column | type | covered by epsilon | meaning |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {c.dtype} | {'yes' if c.covered else '**no**'} | "
              f"{_escape(c.meaning)} |" for name, c in COLUMNS.items()]
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _stock_row(name: str, row: Mapping[str, Any], notes: list[str]) -> str:
    """One model's table row; refusals, failures and Opacus's n/a go to ``notes``."""
    def note(text: str) -> str:
        notes.append(text)
        return f"[{len(notes)}]"

    time, ours, theirs = row["time"], row["ours"], row["opacus"]
    cells = [f"`{name}`", _escape(row["input"]), f"{row['trainable_params']:,}",
             _ms(time["non-private"]["median_s"])]
    for entry, info, who in (("dpsweep DP-SGD", ours, "dpsweep"),
                             ("opacus hooks", theirs, "Opacus")):
        if entry in time:
            t = time[entry]
            cells.append(f"{_ms(t['median_s'])} ({t['ratio_per_round_median']:.2f}x)")
        else:
            cells.append(f"{info['status']} " + note(f"`{name}`, {who} {info['status']}: "
                                                     f"{_escape(info['reason'])}"))
    setup = [f"fix: {', '.join(theirs['fixed'])}"] if theirs.get("fixed") else []
    if theirs.get("functorch"):
        setup.append(f"torch.func on {', '.join(theirs['functorch'])}")
    ours_fix = [f"fix: {', '.join(ours['fixed'])}"] if ours.get("fixed") else []
    cells.append(_escape("; ".join([ours.get("path") or "-", *ours_fix])))
    cells.append(_escape("; ".join(setup)) or "as built")
    vs = row["ours_vs_opacus"]
    if vs is None:
        cells += ["-", "-"]
    else:
        cells += [f"**{vs['median']:.2f}** ({vs['q1']:.2f}-{vs['q3']:.2f})",
                  "yes" if row["within_target"] else "**no**"]
    return "| " + " | ".join(cells) + " |"


def stock_speed_markdown(payload: Mapping[str, Any]) -> str:
    """The stock models' table from a ``bench.stock_models`` results payload."""
    models = payload["models"]
    loads = [x for row in models.values() for x in row.get("load_average_before_after", [])]
    load = f"; 1-minute load average {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    lines = [f"{payload['date']}, commit `{payload['commit']}`; torch {payload['torch']}, "
             f"torchvision {payload['torchvision']}, Opacus {payload['opacus']}; "
             f"{payload['machine']}, {payload['threads']} torch threads{load}; "
             f"{payload['rounds']} interleaved rounds per model; whole run "
             f"{_duration(payload['wall_s'])} (`{STOCK_RESULTS}`).", "",
             "| model | input | trainable parameters | non-private ms | dpsweep DP-SGD ms "
             "(x non-private) | Opacus hooks ms (x non-private) | dpsweep per-example path "
             "| Opacus setup | dpsweep / Opacus hooks (IQR) | "
             f"<= {payload['target']}x |", "|---|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    lines += [_stock_row(name, models[name], notes) for name in payload.get("order", models)]
    if notes:
        lines.append("")
        lines += [f"- [{i}] {text}" for i, text in enumerate(notes, 1)]
    return "\n".join(lines)


def stock_speed_table() -> str:
    path = ROOT / STOCK_RESULTS
    if not path.is_file():
        return f"Not measured yet: `{STOCK_RESULTS}` is missing."
    return stock_speed_markdown(json.loads(path.read_text()))


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else f"{v}" for v in value) + "]"
    if isinstance(value, dict):
        return "{}"
    return tomli_w.dumps({"x": value}).split("=", 1)[1].strip()


def config_reference() -> str:
    """Every config key of every section: default, what is allowed, meaning (``dpsweep
    config`` prints the same declarations as a commented TOML file)."""
    out = []
    for section, cls in SECTIONS.items():
        out += [f"### `[{section}]`", "", "| key | default | allowed | meaning |",
                "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            p = field_param(section, f)
            out.append(f"| `{f.name}` | `{_escape(_toml_value(p.default))}` | "
                       f"{_escape(p.allowed())} | {_escape(p.doc)} |")
        out.append("")
    return "\n".join(out).rstrip()


def datasets_table() -> str:
    """The built-in datasets' pools and default split sizes (and the demo's)."""
    lines = ["| dataset | input | examples (official test split) | train / validation / holdout "
             "/ test / shadow (defaults) |", "|---|---|---|---|"]
    for name in DATASET_NAMES:
        pool, test = POOLS[name]
        s = DEFAULT_SIZES[name]
        sizes = " / ".join(f"{v:,}" for v in (s.train, s.validation, s.holdout, s.test, s.shadow))
        lines.append(f"| `{name}` | {' x '.join(map(str, INPUT_SHAPES[name]))} | {pool:,}"
                     f"{f' ({test:,})' if test else ' (none: cut from the pool)'} | {sizes} |")
    demo = " / ".join(f"{DEMO_SIZES[f'{k}_size']:,}" for k in SPLIT_NAMES)
    lines.append(f"| `digits` in `dpsweep demo` | 1 x 8 x 8 | {POOLS['digits'][0]:,} "
                 f"(none: cut from the pool) | {demo} |")
    return "\n".join(lines)


def _results(name: str) -> dict[str, Any]:
    return json.loads((ROOT / RESULTS / f"{name}.json").read_text())


def _pm(mean: float, sd: float, n: int) -> str:
    return f"{mean:.3f} ± {sd:.3f}" if n > 1 else f"{mean:.3f}"


def _leader(row: Mapping[str, Any], published: bool = False) -> str:
    """How a study's leader was found, and its lr and clip norm."""
    how = ("published" if published
           else "preset" if str(row["trial"]).endswith("-000") else "tuned")
    return f"{how}: lr {row['lr']:.3g}, C {row['clip_norm']:.3g}"


def _fmnist_rows() -> list[tuple[dict[str, Any], bool]]:
    """The full-size study's rows, the published point after DP-SGD's row at its epsilon."""
    rows = [(r, False) for r in _results(FMNIST_FULL)["rows"]]
    for pub in _results(FMNIST_PUBLISHED)["rows"]:
        at = max(i for i, (r, _) in enumerate(rows)
                 if (r["series"], r["epsilon"]) <= (pub["series"], pub["epsilon"]))
        rows.insert(at + 1, (pub, True))
    return rows


def fmnist_table(full: bool = True) -> str:
    """The full-size Fashion-MNIST study (``bench/results/fmnist_full.json`` and the published
    point): per study, its leader over 3 seeds and the audit of the audited ones."""
    head = ["series", "epsilon", "leader", "seeds", "val acc", "test acc", "peak MIA [upper]",
            "peak at", "leak", "ROC eps lower"]
    keep = head if full else ["series", "epsilon", "leader", "test acc", "peak MIA [upper]",
                              "leak"]
    lines = ["| " + " | ".join(keep) + " |", "|" + "---|" * len(keep)]
    for r, published in _fmnist_rows():
        audited = "peak_mia" in r
        cells = {
            "series": r["series"] + ("" if r["dp_valid"] else " (claim invalid)"),
            "epsilon": f"{r['epsilon']:g}", "leader": _leader(r, published),
            "seeds": str(r["seeds"]), "val acc": _pm(r["val_mean"], r["val_sd"], r["seeds"]),
            "test acc": _pm(r["test_mean"], r["test_sd"], r["seeds"]),
            "peak MIA [upper]": (f"{r['peak_mia']:.3f} [{r['peak_mia_upper']:.3f}]"
                                 if audited else "-"),
            "peak at": f"{r['peak_layer']} ({r['peak_attack']})" if audited else "-",
            "leak": ("yes" if r["leak_detected"] else "no") if audited else "-",
            "ROC eps lower": (f"{r['claim_check']['mia_epsilon_lower']:.3f}"
                              if "claim_check" in r else "-")}
        lines.append("| " + " | ".join(cells[k] for k in keep) + " |")
    b = _results(FMNIST_FULL)["baseline"]
    if b:
        cells = {"series": "non-private", "epsilon": "-", "leader": "Adam (`sweep.baseline_lr`)",
                 "seeds": "1", "val acc": f"{b['val']:.3f}", "test acc": f"{b['test']:.3f}",
                 "peak MIA [upper]": f"{b['peak_mia']:.3f}", "peak at": "",
                 "leak": "yes" if b["leak_detected"] else "no", "ROC eps lower": ""}
        lines.append("| " + " | ".join(cells[k] for k in keep) + " |")
    return "\n".join(lines)


def fmnist_headline() -> str:
    return fmnist_table(full=False)


_FINISHED = re.compile(r"sweep finished: (\d+) trials .*? in (\d+(?:\.\d+)?) s")


def fmnist_parts() -> str:
    """Each part of the full-size study: its config, studies, trials and wall time."""
    lines = ["| part | config | studies | trials (pruned, failed) | wall time per attempt "
             "(2 cores) | summed trial time: search, re-runs, audits, baseline |",
             "|---|---|---|---|---|---|"]
    for name in [*_results(FMNIST_FULL)["parts"], FMNIST_PUBLISHED]:
        part = _results(name)
        studies = [f"{r['series']} at {r['epsilon']:g}" + (" (audited)" if "peak_mia" in r
                                                            else "") for r in part["rows"]]
        if part.get("baseline"):
            studies.append("non-private" + (" (audited)" if math.isfinite(
                part["baseline"]["peak_mia"]) else ""))
        walls = ROOT / RESULTS / f"{name}.walls.txt"
        attempts = [float(m.group(2)) / 60 for m in _FINISHED.finditer(walls.read_text())]
        t = part["time"]
        lines.append(
            f"| {name.removeprefix('fmnist_full_')} | `{Path(part['run_dir']).name}.toml` | "
            f"{', '.join(studies)} | {part['trials']} ({part['pruned']}, {part['failed']}) | "
            f"{' + '.join(f'{m:.1f} min' for m in attempts)} | "
            + ", ".join(f"{t[k] / 60:.1f}" for k in ("search_s", "reruns_s", "audits_s",
                                                     "baseline_s")) + " min |")
    return "\n".join(lines)


def fmnist_details() -> str:
    """Per study: the search's work and the leader; then each seed paper's claim."""
    combined = _results(FMNIST_FULL)
    head = ["series", "epsilon", "trials", "finished", "pruned (at epoch)", "leader lr, C, "
            "momentum", "sigma", "steps", "test acc per seed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in combined["rows"]:
        at = sorted(r["pruned_at"].items(), key=lambda rung: int(rung[0]))
        cells = [r["series"], f"{r['epsilon']:g}", str(r["trials"]), str(r["finished"]),
                 f"{r['pruned']}" + (f" ({', '.join(f'{n} at {k}' for k, n in at)})" if at
                                     else ""),
                 f"{r['lr']:.3g}, {r['clip_norm']:.3g}, {r['momentum']:g}",
                 f"{r['noise_multiplier']:.3f}", str(r["steps"]),
                 ", ".join(f"{x:.3f}" for x in r["test_seeds"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {_escape(c)}" for c in combined["claims"]]
    return "\n".join(lines)


def _ratio(entry: Mapping[str, Any]) -> str:
    return (f"{entry['ratio_per_round_median']:.2f} ({entry['ratio_per_round_q1']:.2f}-"
            f"{entry['ratio_per_round_q3']:.2f})")


def step_time_table() -> str:
    """DP-SGD's step over the non-private step on the CPU, against Opacus and torch.func."""
    runs = [_results(name) for name in STEP_TIME]
    lines = ["| model | batch, torch threads, rounds | dpsweep DP-SGD (IQR) | Opacus hooks | "
             "Opacus ghost | torch.func (vmap) | peak memory: dpsweep, hooks, ghost | "
             "re-check: dpsweep, hooks, ghost | targets |", "|---|---|---|---|---|---|---|---|---|"]
    for model, m in runs[0]["models"].items():
        t, mem, c = m["time"], m["memory"], m["config"]
        again = runs[1]["models"][model]["time"]
        targets = "; ".join(f"{k}: {'met' if ok else '**not met**'}"
                            for k, ok in m["targets"].items() if "dpsgd" not in k)
        lines.append(
            f"| `{model}` | {c['batch']}, {c['threads']}, {c['rounds']} | "
            f"**{_ratio(t['engine DP-SGD'])}** | {_ratio(t['opacus hooks'])} | "
            f"{_ratio(t['opacus ghost'])} | {_ratio(t['vmap DP-SGD'])} | "
            + ", ".join(f"{mem[k]['ratio']:.2f}" for k in ("engine DP-SGD", "opacus hooks",
                                                           "opacus ghost")) + " | "
            + ", ".join(f"{again[k]['ratio_per_round_median']:.2f}"
                        for k in ("engine DP-SGD", "opacus hooks", "opacus ghost"))
            + f" | {targets} |")
    return (f"torch {runs[0]['torch']}; times are x the non-private step, medians of per-round "
            f"ratios (`{RESULTS}/{STEP_TIME[0]}.json`; re-check `{RESULTS}/{STEP_TIME[1]}.json`)."
            "\n\n" + "\n".join(lines))


def methods_time_table() -> str:
    """Every method's step over DP-SGD's, in the same rounds, per model."""
    run = _results(STEP_TIME[0])
    models = list(run["models"])
    target = run["method_time_target"]
    lines = ["| method | " + " | ".join(f"`{m}`" for m in models) + f" | <= {target:g}x |",
             "|---|" + "---|" * (len(models) + 1)]
    for method in run["methods"]:
        cells, met = [], []
        for model in models:
            entry = run["models"][model]["methods_vs_dpsgd"]["methods"][method]
            ratio = f"{entry['ratio_per_round_median']:.3f}"
            cells.append(f"**{ratio}**" if entry["meets_target"] is False else ratio)
            met.append(entry["meets_target"])
        verdict = ("-" if any(x is None for x in met) else "yes" if all(met) else "**no**")
        lines.append(f"| `{method}` | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


def gpu_steps_table() -> str:
    """DP-SGD's step over the non-private step on GPUs, against Opacus and torch.func."""
    runs = {name: _results(name) for name in GPU_STEPS}
    head = ["model @ batch"]
    entries = ("engine DP-SGD", "vmap DP-SGD", "opacus hooks", "opacus ghost")
    label = {"engine DP-SGD": "dpsweep", "vmap DP-SGD": "torch.func",
             "opacus hooks": "Opacus hooks", "opacus ghost": "Opacus ghost"}
    for run in runs.values():
        head += [f"{run['device'].split()[1]}: {label[e]}" for e in entries]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = next(iter(runs.values()))
    for key in first["timing"]:
        cells = [f"`{key}`"]
        for run in runs.values():
            got = run["timing"][key]["entries"]
            cells += [f"{got[e]['ratio_median']:.2f}" if e in got else "failed" for e in entries]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for name, run in runs.items():
        worst = {dtype: max(v for case, errs in run["norms"].items() if case.endswith(dtype)
                            for v in errs.values()) for dtype in ("float32", "float64")}
        methods = run["methods"]
        ok = sum(1 for m in methods.values() if m["finite"] and m["moved"])
        capped = sum(m.get("guard_capped", 0) for m in methods.values())
        notes.append(f"- `{RESULTS}/{name}.json`: {run['device']}, torch {run['torch']}; engine "
                     f"vs the exact per-example path at most {worst['float32']:.1e} relative "
                     f"in float32 and {worst['float64']:.1e} in float64; {ok} of "
                     f"{len(methods)} methods step with finite, moving parameters "
                     f"(guard caps: {capped}).")
    return ("Times are x the non-private step (medians of per-round ratios)." + "\n\n"
            + "\n".join(lines) + "\n\n" + "\n".join(notes))


def gpu_trials_table() -> str:
    """Full-size Fashion-MNIST trials (1,000 steps at batch 2048) trained on a GPU."""
    lines = ["| results | device | method at lr, C | epsilon (sigma) | test acc (runs) | wall "
             "time per trial: median (min-max) |", "|---|---|---|---|---|---|"]
    notes: list[str] = []
    for name in GPU_TRIALS:
        run = _results(name)
        reps, s = run["repeats"], run["summary"]
        params = run.get("method_params", {}).get(run.get("method", ""), {})
        method = run.get("method", "dpsgd")
        where = (f"{method} at {params['lr']:.3g}, {params['clip_norm']:.3g}" if params
                 else f"{method} at `{run['config']}`'s point")
        note = ""
        if run.get("note"):
            if run["note"] not in notes:
                notes.append(run["note"])
            note = f" [{notes.index(run['note']) + 1}]"
        lines.append(
            f"| `{name}.json`{note} | {run['device']} | {where} | "
            f"{reps[0]['epsilon_upper']:.3f} ({reps[0]['noise_multiplier']:.3f}) | "
            f"{_pm(s['test_accuracy_mean'], s['test_accuracy_sd'], len(reps))} ({len(reps)}) "
            f"| {s['wall_s_median']:.1f} s ({s['wall_s_min']:.1f}-{s['wall_s_max']:.1f}) |")
    if notes:
        lines.append("")
        lines += [f"- [{i}] {_escape(text)}" for i, text in enumerate(notes, 1)]
    return "\n".join(lines)


def epoch_time_table() -> str:
    """A full-size epoch against steps x the isolated step time."""
    lines = ["| results | epoch (median) | step (median) | epoch / (steps x step) (IQR) | "
             "steps | evaluation | the rest | target |", "|---|---|---|---|---|---|---|---|"]
    for name in EPOCH_TIME:
        run = _results(name)
        s = run["summary"]
        lines.append(
            f"| `{name}.json` | {s['epoch_s_median']:.1f} s | {s['step_s_median']:.3f} s x "
            f"{run['steps_per_epoch']} | **{s['ratio_median']:.3f}** ({s['ratio_iqr'][0]:.3f}-"
            f"{s['ratio_iqr'][1]:.3f}) | {s['share_steps']:.1%} | {s['share_evaluate']:.1%} | "
            f"{s['share_rest']:.1%} | <= {s['target']:g}: {'met' if s['met'] else 'not met'} |")
    run = _results(EPOCH_TIME[0])
    return (f"`{run['config']}`'s trial: {run['members']:,} members, {run['method']} at batch "
            f"{run['batch_size']}, {run['threads']} torch thread.\n\n" + "\n".join(lines))


def canary_digits_table() -> str:
    """White-box canary lower bounds on the digits demo, per method."""
    run = _results(CANARY_DIGITS)
    setup, rows = run["setup"], run["rows"]
    lines = ["| method | claimed epsilon | lower bound per run | median | seconds per audit |",
             "|---|---|---|---|---|"]
    for method, median in run["summary"]["median"].items():
        mine = [r for r in rows if r["method"] == method]
        bounds = ", ".join(f"{r['eps_lower_bound']:.2f}" for r in mine)
        lines.append(
            f"| `{method}` | {mine[0]['claimed_epsilon']:.3f} | {bounds} | {median:.2f} | "
            f"{statistics.median(r['seconds'] for r in mine):.1f} |")
    return (f"{setup['dataset']}, m = {setup['m']} canaries, {setup['repeats']} runs per "
            f"method, {setup['confidence']:.0%} confidence, {setup['threads']} torch thread "
            f"(`{RESULTS}/{CANARY_DIGITS}.json`); every bound below its claim: "
            f"{'yes' if run['summary']['all_below_claim'] else '**no**'}.\n\n"
            + "\n".join(lines))


GENERATORS = {"methods": methods_table, "hyperparameters": hyperparameter_tables,
              "columns": columns_table, "stock_speed": stock_speed_table,
              "config": config_reference, "datasets": datasets_table,
              "fmnist_headline": fmnist_headline, "fmnist_full": fmnist_table,
              "fmnist_parts": fmnist_parts, "fmnist_details": fmnist_details,
              "step_time": step_time_table, "methods_time": methods_time_table,
              "gpu_steps": gpu_steps_table, "gpu_trials": gpu_trials_table,
              "epoch_time": epoch_time_table, "canary_digits": canary_digits_table,
              "search_ranges": search_ranges_table, **runs.GENERATORS,
              **privacy.GENERATORS, **audit.GENERATORS, **zoo.GENERATORS}


def _pattern(block: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{block} -->\n)(?:.*?\n)?(<!-- /generated:{block} -->)",
                      re.DOTALL)


def render(text: str, block: str) -> str:
    """``text`` with the marked ``block`` replaced by freshly generated content."""
    pattern = _pattern(block)
    if not pattern.search(text):
        raise ValueError(f"no <!-- generated:{block} --> block")
    return pattern.sub(lambda m: m.group(1) + GENERATORS[block]() + "\n" + m.group(2), text)


def stale(root: Path = ROOT) -> list[str]:
    """Files whose generated blocks differ from what the code generates now."""
    out = []
    for rel, block in BLOCKS:
        text = (root / rel).read_text()
        if render(text, block) != text:
            out.append(f"{rel} [{block}]")
    return out


def main() -> int:
    for rel, block in BLOCKS:
        path = ROOT / rel
        path.write_text(render(path.read_text(), block))
    print("regenerated: " + ", ".join(f"{rel} [{b}]" for rel, b in BLOCKS))
    return 0

