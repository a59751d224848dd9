"""TOML reading on every Python dpsweep supports: the standard library's ``tomllib`` from 3.11,
the same parser published as ``tomli`` before it. Every reader imports it from here."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

__all__ = ["tomllib"]
