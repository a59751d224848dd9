"""Unit tests of orchestrator/."""
