"""docs/methods.md's "searched" column and docs/search.md's range table say what a sweep searches;
every generator owns a block, and a bench table without its results file states no figure.

Both are checked against the search spaces as sweeps build them (``build_space`` in every
mode), not against ``Space.ranges``: a parameter searched through a reparametrisation (lr as
lr * C) or a model-dependent range (dpsgd_lf's m_f) is searched too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.docgen import runs as docgen_runs
from bench.docgen.blocks import BLOCKS, GENERATORS, RANGE_TABLE_LAYERS, ROOT
from dpsweep.search_spaces import SPACES, STEP, build_space
from dpsweep.trainables.methods import METHODS

_CELL = re.compile(r"(?<!\\)\|")


def _searched_columns() -> dict[str, dict[str, str]]:
    """method -> parameter -> its "searched" cell, from the committed docs/methods.md."""
    text = (ROOT / "docs/methods.md").read_text()
    block = text.split("<!-- generated:hyperparameters -->", 1)[1]
    block = block.split("<!-- /generated:hyperparameters -->", 1)[0]
    out: dict[str, dict[str, str]] = {}
    method, column = "", -1
    for line in block.splitlines():
        if line.startswith("### `"):
            method = line.strip("# `")
            out[method] = {}
        elif line.startswith("| parameter |"):
            column = [c.strip() for c in _CELL.split(line)].index("searched")
        elif line.startswith("| `"):
            cells = [c.strip() for c in _CELL.split(line)]
            out[method][cells[1].strip("`")] = cells[column]
    return out


def _searched_by_sweeps(method: str) -> set[str]:
    if method not in SPACES:
        return set()
    out: set[str] = set()
    for mode in METHODS[method].modes:
        built = build_space(method, mode=mode.name, num_layers=5)
        out |= set(built.distributions) - {STEP}
        out |= {"lr"} if built.step else set()
    return out


def test_searched_column_matches_the_search_spaces() -> None:
    columns = _searched_columns()
    assert set(columns) == set(METHODS)
    for method, cls in METHODS.items():
        shown = columns[method]
        assert set(shown) == {row["name"] for row in cls.declaration().table()}, method
        searched = _searched_by_sweeps(method)
        assert searched <= set(shown), (method, searched - set(shown))
        wrong = {name: cell for name, cell in shown.items()
                 if (cell == "yes") != (name in searched)}
        assert not wrong, f"{method}: searched column disagrees with the space for {wrong}"
    assert columns["dpsgd"]["lr"] == "yes" and columns["dpsgd_lf"]["m_f"] == "yes"


def _range_rows() -> dict[tuple[str, str], str]:
    """(method, parameter) -> its range cell, from docs/search.md's generated block."""
    text = (ROOT / "docs/search.md").read_text()
    block = text.split("<!-- generated:search_ranges -->", 1)[1]
    block = block.split("<!-- /generated:search_ranges -->", 1)[0]
    out = {}
    for line in block.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in _CELL.split(line)]
            out[(cells[1].strip("`"), cells[2].split()[0].strip("`"))] = cells[3]
    return out


def test_search_ranges_table_states_every_range_a_sweep_searches() -> None:
    """docs/search.md's range table names every dimension ``build_space`` searches in some mode,
    with its bounds, and nothing else."""
    rows = _range_rows()
    expected: dict[tuple[str, str], str] = {}
    for method in SPACES:
        for mode in METHODS[method].modes:
            built = build_space(method, mode=mode.name, num_layers=RANGE_TABLE_LAYERS)
            for key, dist in built.distributions.items():
                expected[(method, key)] = (
                    "one of " + ", ".join(f"{c:g}" for c in dist.choices)
                    if hasattr(dist, "choices") else f"{dist.low:g} to {dist.high:g}")
    assert set(rows) == set(expected)
    for key, cell in rows.items():
        assert cell.startswith(expected[key]), (key, cell, expected[key])
    assert ("dpsgd", STEP) in rows and ("dpsgd_lf", "m_f") in rows


def test_every_generator_fills_a_block_of_its_page() -> None:
    """A generator no block names writes nothing; a block no page holds checks nothing."""
    assert {block for _, block in BLOCKS} == set(GENERATORS)
    for rel, block in BLOCKS:
        assert f"<!-- generated:{block} -->" in (ROOT / rel).read_text(), (rel, block)


def test_a_missing_results_file_gives_no_figures(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """Without its committed file a bench table says how to measure it, never a number."""
    monkeypatch.setattr(docgen_runs, "RESULTS_DIR", tmp_path)
    for name, generate in docgen_runs.GENERATORS.items():
        text = generate()
        assert "Not measured" in text and not re.search(r"\d+\.\d+", text), name
