"""dpsweep orchestrator: CLI, config schema, PRV budget matching, sweep, run directory."""

from core import __version__

__all__ = ["__version__"]
