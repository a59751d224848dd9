"""The bottom floor: errors, shared types and storage primitives every other package uses.

dpsweep's packages form floors that import only downward (``docs/design.md``, "Floors"):

    orchestrator  ->  search_spaces  ->  trainables  ->  reports  ->  core

``core`` imports none of them and no heavy library (no torch, no scipy), so the command line can
answer ``dpsweep budget`` or ``dpsweep config --check`` without loading a deep-learning stack.
"""

__version__ = "0.2.0"
