"""README.md is a front door and docs/ describes the present, with links that resolve.

- README.md stays short (at most ``README_MAX_LINES``) and links every page of docs/.
- No dated narration: ``grep -nE "20[0-9]{2}-[0-9]{2}-[0-9]{2}|today|used to|quieter"`` finds
  nothing in README.md or docs/*.md. The one exception is text inside generated blocks
  (``<!-- generated:NAME -->``, written by ``bench.docgen``): there a run's date may
  appear (the date a committed results file records for its run, e.g. the stock models'
  table), and so may "used to choose", the declarations' own wording of the test split in
  ``orchestrator/config`` and ``reports/store.py`` ("reported, never used to choose": used in
  order to choose, not narration). Hand-written text has neither.
- Every relative link in README.md and docs/*.md names a file that exists, and a link to a
  heading of a Markdown file names a heading that exists.
- Every table that carries a measured figure lies inside a generated block, so each figure is one
  a committed ``bench/results`` file holds (issue 34); a hand-written table with a figure is
  allowed only in ``REFERENCE_TABLES``, each with its reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: The acceptance grep of issue 34, verbatim.
NARRATION = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|today|used to|quieter")
#: What a generated block may contain that hand-written text may not (see the module docstring).
GENERATED_ALLOWED = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|used to choose")
_BLOCK = re.compile(r"<!-- generated:(\w+) -->\n.*?<!-- /generated:\1 -->", re.DOTALL)
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _narration(text: str) -> list[str]:
    """Lines the grep finds, minus what generated blocks may hold."""
    spans = [m.span() for m in _BLOCK.finditer(text)]
    out = []
    offset = 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        start, offset = offset, offset + len(line)
        if not NARRATION.search(line):
            continue
        generated = any(a <= start < b for a, b in spans)
        if generated and not NARRATION.search(GENERATED_ALLOWED.sub("", line)):
            continue
        out.append(f"{number}: {line.strip()[:120]}")
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_FENCE.sub("", path.read_text()))]


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / target.split("#")[0]).resolve() for target in _links(ROOT / "README.md")}
    missing = [_name(p) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_no_dated_narration(path: Path) -> None:
    found = _narration(path.read_text())
    assert not found, f"{_name(path)} narrates (describe the present; history lives in git):\n" \
                      + "\n".join(found)


def test_the_narration_check_catches_what_it_should() -> None:
    assert _narration("measured today\n") and _narration("it used to crash\n")
    assert _narration("done 2026-11-26\n") and _narration("a quieter hour\n")
    block = "<!-- generated:x -->\n2026-11-27, commit `abc`\nnever used to choose\n" \
            "<!-- /generated:x -->\n"
    assert not _narration(block)
    assert _narration("<!-- generated:x -->\nit used to fail\n<!-- /generated:x -->\n")
    assert _narration("never used to choose\n")  # outside a generated block


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (ROOT not in dest.parents and dest != ROOT):
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading in {_name(dest)})")
    assert not broken, f"{_name(path)}: " + "; ".join(broken)


def test_the_slugs_follow_github() -> None:
    assert _slug("The demo's setting and the current ranges") == \
        "the-demos-setting-and-the-current-ranges"
    assert _slug("Private tuning: what it runs, what it refuses") == \
        "private-tuning-what-it-runs-what-it-refuses"
    assert _slug("`[data]`") == "data"
    assert _slug("Stopping weak trials early (adaptive tuning)") == \
        "stopping-weak-trials-early-adaptive-tuning"


#: A file of the repository named in code spans: `orchestrator/sweep/driver.py`.
CODE_PATH = re.compile(r"`((?:core|orchestrator|trainables|search_spaces|reports|bench|tests|"
                       r"configs|examples)/[\w/.-]+\.(?:py|toml|sh|json))`")


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_every_file_a_page_names_exists(path: Path) -> None:
    """Code moves; a page that still names the old file sends a maintainer nowhere."""
    named = sorted(set(CODE_PATH.findall(path.read_text())))
    missing = [name for name in named if not (ROOT / name).exists()]
    assert not missing, f"{_name(path)} names files that do not exist: {missing}"


#: A figure: a decimal number (0.73, 1.46) or a number with a unit of time, ratio or share
#: (34 s, 120 ms, 58 min, 1.7x, 7.2%). Integers alone (counts, sizes, epsilons) are not: too
#: many reference tables hold them, and a measurement almost never comes without one of these.
FIGURE = re.compile(r"(?<![\w.])(?:\d+\.\d+|\d+(?:\.\d+)? ?(?:s|ms|min|h|x|%))(?![\w.])")
_CODE_SPAN = re.compile(r"`[^`]*`")
_SEPARATOR = re.compile(r"^\|(?:\s*:?-+:?\s*\|)+\s*$")
#: Hand-written tables that may hold figures or bindings because they are not benchmark
#: results: (page, header row) -> why.
_LOCAL_BINDINGS = ("| process | purpose | before (plain "
                   "`ray.init(_node_ip_address=\"127.0.0.1\")`) | now |")
REFERENCE_TABLES = {
    ("docs/security.md", _LOCAL_BINDINGS):
        "listener bindings: reference facts tests/system/test_cluster.py re-measures on every "
        "run (no socket off loopback), not benchmark figures",
    ("docs/security.md", "| process | bind |"):
        "listener bindings of a cluster node: reference facts tests/system/test_cluster.py checks",
    ("docs/security.md", "| address | plain `ray.init(address=...)` | `connect()` |"):
        "connect()'s behaviour per bad address; tests/system/test_cluster.py asserts each case "
        "fails within its bound (FAST_S) on every run, and Ray's own retry counts are its "
        "documented settings, not a benchmark",
    ("docs/design.md", "| command | module |"):
        "the deferred-imports reference: which light command keeps which module out",
    ("docs/gpu.md", "| candidate | what it does |"): "the decimals are arXiv identifiers",
}


def _tables(text: str) -> list[tuple[str, list[str]]]:
    """(header row, body rows) of every Markdown table outside code fences and generated
    blocks."""
    lines = _BLOCK.sub("", _FENCE.sub("", text)).splitlines()
    out, i = [], 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and _SEPARATOR.match(lines[i + 1]):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append((lines[i].strip(), lines[i + 2:j]))
            i = j
        else:
            i += 1
    return out


def _hand_written_figures(page: str, text: str) -> list[str]:
    """Header rows of the hand-written tables of ``page`` that carry a figure, less the
    reference tables."""
    return [head for head, rows in _tables(text)
            if (page, head) not in REFERENCE_TABLES
            and any(FIGURE.search(_CODE_SPAN.sub("", row)) for row in rows)]


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_every_table_of_figures_is_generated(path: Path) -> None:
    found = _hand_written_figures(_name(path), path.read_text())
    assert not found, (f"{_name(path)}: tables with measured figures outside a generated block "
                       "(generate them from a committed bench/results file with "
                       "bench.docgen, or list a reference table in REFERENCE_TABLES): "
                       f"{found}")


def test_every_reference_table_exists() -> None:
    """An exemption whose table has gone (or whose header changed) exempts nothing: drop it."""
    heads = {(_name(p), head) for p in PAGES for head, _ in _tables(p.read_text())}
    assert not set(REFERENCE_TABLES) - heads, set(REFERENCE_TABLES) - heads


def test_the_figure_check_catches_a_hand_written_table() -> None:
    planted = "| what | measured |\n|---|---|\n| the demo | 69.8 s |\n"
    assert _hand_written_figures("docs/x.md", planted) == ["| what | measured |"]
    for cell in ("34 s", "1.76x", "7.2%", "120 ms", "0.683", "58 min"):
        assert _hand_written_figures("docs/x.md", f"| a |\n|---|\n| {cell} |\n"), cell
    generated = f"<!-- generated:x -->\n{planted}<!-- /generated:x -->\n"
    assert not _hand_written_figures("docs/x.md", generated)
    reference = "| key | default |\n|---|---|\n| `lr` | 21 trials, epsilon 3, `0.5` |\n"
    assert not _hand_written_figures("docs/x.md", reference)
    fenced = f"```\n{planted}```\n"
    assert not _hand_written_figures("docs/x.md", fenced)
