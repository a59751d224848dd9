"""``core.lazy.lazy_module``: deferred until used, and then the same module an import gives."""

from __future__ import annotations

import subprocess
import sys

#: A package with a submodule that nothing in a fresh interpreter has imported.
CHECK = """\
import sys
from dpsweep.core.lazy import lazy_module
lazy = lazy_module("json.tool")
assert "json.tool" in sys.modules
import json.tool
assert json.tool is lazy, "import gives another module object"
assert callable(json.tool.main)
print("ok")
"""


def test_a_lazy_submodule_is_reachable_from_its_package_like_an_imported_one() -> None:
    """``import a.b`` after ``lazy_module("a.b")`` must find ``a.b`` as an attribute of ``a``
    (the export's ``safetensors.torch.save`` failed with AttributeError without it)."""
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
