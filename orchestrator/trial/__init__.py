"""One trial: ``plan`` (from a config to a trial's spec, its budget matched), ``runner`` (one
trial under Ray Tune: train, audit, record) and ``single`` (``dpsweep train``: one trial, no
sweep).

Nothing is re-exported: each module's imports (torch among them) are paid only by its users.
"""
