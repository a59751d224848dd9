"""Unit tests, one folder per package."""
