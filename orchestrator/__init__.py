"""dpsweep orchestrator: CLI, config schema, run directory, cluster, Python API, and one
package per concern: ``sweep``, ``trial``, ``release``, ``audit``, ``accounting``."""

from dpsweep.core import __version__

__all__ = ["__version__"]
