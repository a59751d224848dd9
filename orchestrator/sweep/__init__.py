"""``dpsweep run`` / ``resume`` / ``demo``: the sweep, by concern.

``driver`` (``run_sweep``, ``resume_sweep``: validation, the run directory, Ray, the results),
``signals`` (how a sweep is stopped, and its progress bars), ``plans`` (which studies a sweep
runs, and the budgets precomputed for them), ``studies`` (the Optuna studies, their outcomes,
and how a crash is reconciled), ``tuning`` (adaptive or private tuning), ``jobs`` (what runs
after the search: audits, re-runs, the non-private baseline), ``raytune`` (what Ray Tune calls:
the searcher, the stopper, the trainable; imported only when Tune runs).

Nothing is re-exported: ``dpsweep budget`` and the other light commands must not pay for the
sweep's imports.
"""
