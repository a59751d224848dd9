"""A built-in export (``load.py`` and dpsweep's own ``core`` and ``trainables`` as its hashed
``code/``) loaded as a stranger would: in a fresh ``python -I -S`` without dpsweep, in their own
folder. A planted bytecode cache beside the source is refused in one line and never runs; the
intact copy loads from its hashed source, gives the recorded test accuracy and writes no
bytecode. This process has imported dpsweep's packages, so only a new process can show it; the
rest of the loader is tests/unit/orchestrator/test_export_loader.py, whose fixtures this uses.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import site
import subprocess
import sys
from pathlib import Path

import torch

from tests.unit.orchestrator.test_export import Trained
from tests.unit.orchestrator.test_export_loader import (  # the fixtures: the same release
    NETWORKS,
    UNLISTED,
    _copy,
    release,  # noqa: F401
    trained,  # noqa: F401
)

TIMEOUT = 300


#: Run in the fresh process, in the stranger's folder: the planted copy, then the intact one.
FRESH = """\
import json, sys
from pathlib import Path
sys.path.extend({site!r})
sys.path.insert(0, "intact")
import load
import torch
try:
    load.load(Path("planted"))
    print("PLANTED LOADED")
except load.ExportError as exc:
    print("PLANTED REFUSED", exc)
except ImportError as exc:
    print("PLANTED IMPORT ERROR", exc)
model = load.load(Path("intact"))
data = torch.load("digits.pt", weights_only=True)
with torch.no_grad():
    right = int((model(data["x"]).argmax(1) == data["y"]).sum())
print("RIGHT", right, "OF", len(data["y"]))
print("CACHES", sorted(str(p) for p in Path("intact/code").rglob("__pycache__")))
print("FROM", sys.modules["dpsweep.trainables.models.networks"].__file__)
"""


def _planted_pyc(code: Path, *, marker: Path) -> Path:
    """A bytecode cache for networks.py compiled from altered source (it writes ``marker``),
    whose header carries the untouched .py's mtime and size, so Python's import would take it
    for a valid cache of the .py and run it instead."""
    source = code / NETWORKS
    altered = source.read_bytes() + f"\nopen({str(marker)!r}, 'w').write('ran')\n".encode()
    compiled = compile(altered, str(source), "exec", dont_inherit=True)
    st = source.stat()
    data = importlib._bootstrap_external._code_to_timestamp_pyc(  # type: ignore[attr-defined]
        compiled, int(st.st_mtime), st.st_size)
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir()
    pyc.write_bytes(data)
    # Python's own loader accepts it as networks.py's cache and returns the altered code.
    spec = importlib.util.spec_from_file_location("planted_check", source)
    assert spec is not None and spec.loader is not None
    assert str(marker) in spec.loader.get_code("planted_check").co_consts  # type: ignore[attr-defined]
    return pyc


def test_a_planted_bytecode_cache_is_refused_and_never_runs(trained: Trained, release: Path,  # noqa: F811
                                                            tmp_path: Path) -> None:
    """The documented use (``import load; load.load(DIR)``) in a fresh process without
    dpsweep: the planted copy is refused in one line and its code never runs; the intact copy
    loads from its hashed source, gives the recorded test accuracy and writes no bytecode."""
    from dpsweep.trainables.data.splits import load_pool

    planted = _copy(release, tmp_path / "planted")
    _copy(release, tmp_path / "intact")
    marker = tmp_path / "planted-code-ran"
    pyc = _planted_pyc(planted / "code", marker=marker)
    test = trained.data.test
    torch.save({"x": torch.from_numpy(load_pool(dataset="digits").x[test.indices]),
                "y": test.y}, tmp_path / "digits.pt")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c",
                           FRESH.format(site=site.getsitepackages())],
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert not marker.exists(), proc.stdout  # the planted code never ran
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    refused = UNLISTED.format(pyc.relative_to(planted / "code").as_posix())
    assert lines[0] == f"PLANTED REFUSED {refused}", lines
    recorded = json.loads((trained.root / "history.json").read_text())[-1]["test_accuracy"]
    assert lines[1] == f"RIGHT {round(recorded * len(test.y))} OF {len(test.y)}"
    assert lines[2] == "CACHES []"  # loading wrote no bytecode into the export
    assert lines[3] == f"FROM {tmp_path / 'intact' / 'code' / NETWORKS}"

