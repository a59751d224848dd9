"""``dpsweep run`` / ``resume`` / ``demo`` / ``reaudit``: the sweep, by concern.

``commands`` (the first three as the command line runs them), ``reaudit`` (the membership audit
of finished trials again, without training), ``driver`` (``run_sweep``, ``resume_sweep``:
validation, the run directory, Ray), whose attempt is ``search`` (the studies,
the trial configs and the Tune experiment), ``aftersearch`` (fronts, audits, re-runs and the
baseline after the search), ``pooling`` (each audited trial scored with its study's
references at the end) and ``records`` (rows, trial records, progress lines, the summary);
``signals`` (how a sweep is stopped by a signal), ``progress`` (its progress bars),
``resume_checks`` (what a resume verifies first, and how a full disk stops a sweep), ``plans``
(which studies a sweep runs, and the budgets precomputed for them), ``studies`` (the Optuna
studies, their outcomes, and how a crash is reconciled), ``tuning`` (adaptive or private
tuning), ``jobs`` (what runs after the search: audits, re-runs, the non-private baseline),
``raytune`` (what Ray Tune calls: the searcher, the stopper, the trainable; imported only when
Tune runs), ``summary`` (the attempts and summary.json), ``ray_start`` (starting Ray quietly).

Nothing is re-exported: ``dpsweep budget`` and the other light commands must not pay for the
sweep's imports.
"""
