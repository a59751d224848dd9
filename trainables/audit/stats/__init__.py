"""The audit's statistics, next to the attacks they judge (numpy / scipy / statsmodels only).

* :mod:`trainables.audit.stats.attacks` — intervals, per-attack statistics, the Holm-corrected
  peak over attacks, and the DP-consistency check of ROC points.
* :mod:`trainables.audit.stats.onerun` — the one-run canary epsilon lower bound.
"""
