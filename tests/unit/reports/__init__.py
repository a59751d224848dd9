"""Unit tests of reports/."""
