"""The house's rooms: each fact written once, rooms of a bounded size, imports at the top.

A fact typed twice drifts: a status spelled by the driver and again by the report, the Poisson
rate computed by the loader and again by the CLI. These tests read the package's source (its
syntax tree, not its text, so docstrings and comments may name the facts freely) and fail on a
second copy, naming where it is.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpsweep.core.poisson import PHYSICAL_BATCH
from dpsweep.core.vocabulary import DISK_FULL_KEY, PRIVATE_SPLITS, SPLIT_NAMES, STATUSES
from dpsweep.trainables.methods import METHODS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "orchestrator", "trainables", "search_spaces", "reports")
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
#: Imports inside functions across the package, each listed with its reason in docs/design.md.
MAX_DEFERRED_IMPORTS = 60
DESIGN = ROOT / "docs" / "design.md"
#: Where each shared fact is written.
VOCABULARY = ROOT / "core" / "vocabulary.py"
POISSON = ROOT / "core" / "poisson.py"


def _package_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (or bare string statements)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def _constants(path: Path) -> Iterator[tuple[int, object]]:
    """(line, value) of every constant in code, docstrings left out."""
    tree = _tree(path)
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in skip:
            yield node.lineno, node.value


def deferred_imports(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every import inside a function body."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [(node.name, sub.lineno) for sub in ast.walk(node)
                      if isinstance(sub, ast.Import | ast.ImportFrom)]
    return found


def test_no_loose_module_under_trainables() -> None:
    loose = sorted(p.name for p in (ROOT / "trainables").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"trainables/ holds modules outside its sub-packages: {loose}"


@pytest.mark.parametrize("path", _package_files(), ids=_rel)
def test_rooms_are_bounded(path: Path) -> None:
    lines = path.read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{_rel(path)}: {lines} lines > {MAX_FILE_LINES}"
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, \
                f"{_rel(path)}: class {node.name} spans {size} lines > {MAX_CLASS_LINES}"


def _design_listing() -> set[tuple[str, str]]:
    """(file, function) pairs of docs/design.md's table of deferred imports."""
    text = DESIGN.read_text()
    return set(re.findall(r"^\| `([\w/]+\.py)` \| `(\w+)` \|", text, flags=re.M))


def test_deferred_imports_are_few_and_each_has_its_reason_in_the_design() -> None:
    found = {(_rel(p), fn): n for p in _package_files()
             for fn, n in _count_by_function(deferred_imports(p))}
    total = sum(found.values())
    assert total <= MAX_DEFERRED_IMPORTS, f"{total} imports inside functions > " \
                                          f"{MAX_DEFERRED_IMPORTS}: {sorted(found)}"
    listed = _design_listing()
    assert set(found) == listed, (f"deferred imports without a reason in docs/design.md: "
                                  f"{sorted(set(found) - listed)}; listed but gone: "
                                  f"{sorted(listed - set(found))}")


def _count_by_function(found: list[tuple[str, int]]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for fn, _ in found:
        counts[fn] = counts.get(fn, 0) + 1
    return list(counts.items())


def _copies(predicate: object, *, home: Path) -> list[str]:
    return [f"{_rel(p)}:{line}" for p in _package_files() if p != home
            for line, value in _constants(p) if predicate(value)]


def _batch_defaults(path: Path) -> Iterator[tuple[int, object]]:
    """(line, value) of what a name or a parameter about a batch is set to: defaults of
    parameters, keyword arguments and assignments whose name mentions a batch."""
    for node in ast.walk(_tree(path)):
        pairs: list[tuple[str, ast.AST]] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            pairs += list(zip([a.arg for a in args.args[len(args.args) - len(args.defaults):]],
                              args.defaults, strict=True))
            pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults,
                                                 strict=True) if d is not None]
        elif isinstance(node, ast.keyword) and node.arg:
            pairs.append((node.arg, node.value))
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            pairs += [(ast.unparse(t), node.value) for t in targets]
        for name, value in pairs:
            if "batch" in name.lower():
                yield from ((sub.lineno, sub.value) for sub in ast.walk(value)
                            if isinstance(sub, ast.Constant))


def test_the_physical_batch_is_written_once() -> None:
    copies = [f"{_rel(p)}:{line}" for p in _package_files() if p != POISSON
              for line, value in _batch_defaults(p)
              if value == PHYSICAL_BATCH and type(value) is int]
    assert not copies, f"{PHYSICAL_BATCH} as a batch outside core/poisson.py: {copies}"


def test_the_split_names_are_written_once() -> None:
    """A copy of the tuple (or of its private part); a subset in an order of its own (which
    splits a step cuts or places) is a fact of that step."""
    copies = []
    for path in _package_files():
        if path == VOCABULARY:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Tuple | ast.List) and all(
                    isinstance(e, ast.Constant) for e in node.elts) and tuple(
                    e.value for e in node.elts) in (SPLIT_NAMES, PRIVATE_SPLITS):
                copies.append(f"{_rel(path)}:{node.lineno}")
    assert not copies, f"the split names outside core/vocabulary.py: {copies}"


def _status_uses(path: Path) -> Iterator[tuple[int, str]]:
    """(line, word) where a status word is used as a trial's status: compared with, stored
    under or passed as something named ``status``, or an ``Outcome``'s first argument."""
    words = set(STATUSES)

    def word(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and node.value in words else None

    for node in ast.walk(_tree(path)):
        found: list[ast.AST] = []
        if isinstance(node, ast.Compare) and "status" in ast.unparse(node).lower():
            found = [node.left, *node.comparators]
            found += [e for c in node.comparators
                      if isinstance(c, ast.Tuple | ast.Set | ast.List) for e in c.elts]
        elif isinstance(node, ast.Dict):
            found = [v for k, v in zip(node.keys, node.values, strict=True)
                     if isinstance(k, ast.Constant) and k.value == "status"]
        elif isinstance(node, ast.keyword) and node.arg == "status":
            found = [node.value]
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any("status" in ast.unparse(t).lower() for t in targets):
                found = [node.value]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Outcome") \
                and node.args:
            found = [node.args[0]]
        yield from ((n.lineno, w) for n in found if (w := word(n)) is not None)


def test_statuses_and_the_disk_full_key_are_written_once() -> None:
    copies = [f"{_rel(p)}:{line} {w!r}" for p in _package_files() if p != VOCABULARY
              for line, w in _status_uses(p)]
    copies += _copies(lambda v: v == DISK_FULL_KEY, home=VOCABULARY)
    assert not copies, f"a status or the disk-full key spelled outside core/vocabulary.py: {copies}"


def test_the_poisson_rate_is_computed_once() -> None:
    """q = 1/ceil(N/B): a ``ceil`` of a division by a batch size anywhere else is a second copy."""
    copies = []
    for path in _package_files():
        if path == POISSON:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ceil" \
                    and node.args and isinstance(node.args[0], ast.BinOp) \
                    and isinstance(node.args[0].op, ast.Div) \
                    and "batch" in ast.unparse(node.args[0].right):
                copies.append(f"{_rel(path)}:{node.lineno}")
    assert not copies, f"ceil(N / batch) outside core/poisson.py: {copies}"


def _method_names_in(path: Path, names: list[str]) -> list[tuple[int, str]]:
    """(line, literal) of every string in code that names one of ``names`` as a word."""
    word = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return [(line, value) for line, value in _constants(path)
            if isinstance(value, str) and word.search(value)]


def test_reports_name_no_method() -> None:
    """The report shows what each method declares of itself (``reports.series``, handed in by
    the caller); a method's name in reports/ would be a second home for that."""
    names = sorted(METHODS)
    found = [f"{_rel(p)}:{line} {value!r}" for p in sorted((ROOT / "reports").rglob("*.py"))
             for line, value in _method_names_in(p, names)]
    assert not found, f"a registered method named in reports/: {found}"


def test_bench_imports_nothing_from_tests() -> None:
    bad = []
    for path in sorted((ROOT / "bench").rglob("*")):
        if path.suffix in {".py", ".sh"} and re.search(r"^\s*(from|import) tests\b",
                                                        path.read_text(), flags=re.M):
            bad.append(_rel(path))
    assert not bad, f"bench/ imports tests/: {bad}"


def test_the_checks_catch_a_copy(tmp_path: Path) -> None:
    """The predicates see a planted copy in code and ignore one in a docstring."""
    planted = tmp_path / "planted.py"
    planted.write_text('"""ok, 512, pruned."""\nSTATUS = "ok"\nBATCH = 512\n'
                       'def f():\n    import json\n    return json\n')
    values = [v for _, v in _constants(planted)]
    assert "ok" in values and 512 in values and "ok, 512, pruned." not in values
    assert deferred_imports(planted) == [("f", 5)]
    used = tmp_path / "used.py"
    used.write_text('def f(row, batch_size=512, chunk=512):\n'
                    '    if row["status"] == "ok":\n        return {"status": "pruned"}\n'
                    '    answer = "ok"\n    return Outcome("failed", answer)\n')
    assert sorted(_status_uses(used)) == [(2, "ok"), (3, "pruned"), (5, "failed")]
    assert [v for _, v in _batch_defaults(used)] == [512]
    named = tmp_path / "named.py"
    named.write_text('"""ww_dpsgd in a docstring."""\nA = "ww_dpsgd"\nB = f"{A}: no ww_dpsgd"\n'
                     'C = "ww_trajectories"\nD = "lm_dpsgd_x dpsgd"\n')
    assert sorted(_method_names_in(named, ["ww_dpsgd", "dpsgd"])) == [
        (2, "ww_dpsgd"), (3, ": no ww_dpsgd"), (5, "lm_dpsgd_x dpsgd")]


def _unprefixed(name: str) -> str:
    """``dpsweep.core.x`` as the path-based name ``core.x`` (the packages sit at the top level
    of the repository and install under ``dpsweep``)."""
    return name.removeprefix("dpsweep.")


def _module_name(path: Path) -> str:
    return _rel(path)[:-3].replace("/", ".").removesuffix(".__init__")


def _top_level_imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports when it is imported (TYPE_CHECKING blocks and
    function bodies left out): ``from a import b`` counts ``a.b`` when that is a module."""
    found: set[str] = set()
    for node in _tree(path).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        body = (node.body + node.orelse if isinstance(node, ast.If)
                else node.body if isinstance(node, ast.Try) else [node])
        for sub in body:
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                found |= {sub.module, *(f"{sub.module}.{a.name}" for a in sub.names)}
    return {_unprefixed(n) for n in found} & known - {_module_name(path)}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _every_import(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere: at the top, inside functions and under
    ``TYPE_CHECKING`` (a circle held apart by a deferred import is still a circle)."""
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {_unprefixed(n) for n in found} & known - {_module_name(path)}


#: Circles left, counting every import, each a pair that issue 42's one door removes: the
#: config's cross checks resolve a setup, and the setup reads the config. The list only
#: shrinks: a new circle, or one gone without its entry removed, fails the test.
KNOWN_CIRCLES: list[list[str]] = []


def test_no_import_cycle() -> None:
    paths = {_module_name(p): p for p in _package_files()}
    graph = {m: _top_level_imports(p, set(paths)) for m, p in paths.items()}
    assert import_cycles(graph) == []


def test_no_import_cycle_counting_every_import() -> None:
    files = _package_files() + sorted((ROOT / "bench").rglob("*.py"))
    paths = {_module_name(p): p for p in files}
    graph = {m: _every_import(p, set(paths)) for m, p in paths.items()}
    assert import_cycles(graph) == KNOWN_CIRCLES


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_every_import_of_dpsweep_goes_through_dpsweep() -> None:
    """``import core`` would load a second copy of a module (or a user's package of that name):
    every import of dpsweep's packages is ``dpsweep.<package>``, in the packages, bench, tests
    and examples alike."""
    files = sorted(p for top in (*PACKAGES, "bench", "tests", "examples", "docs")
                   for p in (ROOT / top).rglob("*.py"))
    bare = []
    for path in files:
        for node in ast.walk(_tree(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     and node.module else [])
            bare += [f"{_rel(path)}:{node.lineno} {n}" for n in names
                     if n.split(".")[0] in PACKAGES]
    assert bare == []
