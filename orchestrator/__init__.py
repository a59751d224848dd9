"""dpsweep orchestrator: CLI, config schema, PRV budget matching, sweep, results store."""

__version__ = "0.1.0"
