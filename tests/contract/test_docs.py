"""README.md is a front door and docs/ describes the present, with links that resolve.

- README.md stays short (at most ``README_MAX_LINES``) and links every page of docs/.
- No dated narration: ``grep -nE "20[0-9]{2}-[0-9]{2}-[0-9]{2}|today|used to|quieter"`` finds
  nothing in README.md or docs/*.md. The one exception is text inside generated blocks
  (``<!-- generated:NAME -->``, written by ``orchestrator.docgen``): there a run's date may
  appear (the date a committed results file records for its run, e.g. the stock models'
  table), and so may "used to choose", the declarations' own wording of the test split in
  ``orchestrator/config`` and ``reports/store.py`` ("reported, never used to choose": used in
  order to choose, not narration). Hand-written text has neither.
- Every relative link in README.md and docs/*.md names a file that exists, and a link to a
  heading of a Markdown file names a heading that exists.
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
