"""Privacy audits: ``membership`` (the per-layer membership-inference audit of one model, run in
a trial or after the search, and what its record claims), ``stored`` (the signals file each
audit keeps), ``pooling`` (an audit scored again with the references of its study's other
trials) and ``canary`` (``dpsweep audit``: an empirical epsilon lower bound from one extra
training run with canaries).

Nothing is re-exported: each module's imports (torch among them) are paid only by its users.
"""
