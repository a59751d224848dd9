"""The wheel's layout (docs/design.md, "Packaging"): dpsweep's packages sit at the repository's
top level and install under ``dpsweep/``, so the only top-level name a user's environment gets
is ``dpsweep``; ``bench`` (with the docs generator), ``docs``, ``tests`` and ``examples`` stay
out. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

#: The repository's top-level packages, installed as ``dpsweep.<name>`` (``dpsweep.PACKAGES``).
PACKAGES = ("core", "trainables", "search_spaces", "orchestrator", "reports")

found = find_packages(include=[p for top in PACKAGES for p in (top, f"{top}.*")])
setup(packages=["dpsweep", *(f"dpsweep.{name}" for name in found)],
      package_dir={"dpsweep": "dpsweep", **{f"dpsweep.{top}": top for top in PACKAGES}})
