"""Privacy accounting, one module per concern; each imports only those listed before it:

``certificate`` (what a calibration promises, and the accountants' input checks), ``prv`` (the
PRV accountant and the integer-order RDP bound that sets its domain), ``verify`` (dp_accounting's
independent checks), ``search`` (the calibration search), ``sandbox`` (the search in a bounded
child), ``cache`` (verified answers on disk), ``calibration`` (budget matching, the entry point,
and the epsilon spent after each epoch); ``tuning`` (a sub-package: ``private`` and ``adaptive``)
for the cost of tuning.

Budget matching's API is re-exported here. Private tuning's is not: its modules import numpy and
dp_accounting, which ``dpsweep budget`` cannot afford and whose threads would keep the PRV
sandbox from forking; import it from its module.
"""

from dpsweep.orchestrator.accounting.cache import default_cache_dir
from dpsweep.orchestrator.accounting.calibration import calibrate, certify, epsilon_curve
from dpsweep.orchestrator.accounting.certificate import WINDOW
from dpsweep.orchestrator.accounting.prv import prv_epsilon
from dpsweep.orchestrator.accounting.sandbox import keep_interpreters
from dpsweep.orchestrator.accounting.verify import (
    IndependentCheck,
    epsilon_of_events,
    rdp_epsilon,
    schedule_events,
    verify_calibration,
)

__all__ = [
    "WINDOW",
    "IndependentCheck",
    "calibrate",
    "certify",
    "default_cache_dir",
    "epsilon_curve",
    "epsilon_of_events",
    "keep_interpreters",
    "prv_epsilon",
    "rdp_epsilon",
    "schedule_events",
    "verify_calibration",
]
