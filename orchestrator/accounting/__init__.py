"""Privacy accounting, one module per concern; each imports only those listed before it:

``limits`` (input checks), ``certificate`` (what a calibration promises), ``rdp`` (integer-order
RDP), ``prv`` (the PRV accountant), ``verify`` (dp_accounting's independent checks), ``search``
(the calibration search), ``sandbox`` (the search in a bounded child), ``cache`` (verified
answers on disk), ``curve`` (epsilon per epoch), ``calibration`` (budget matching, the entry
point); ``private_tuning`` and ``adaptive`` for the cost of tuning.

Budget matching's API is re-exported here. Private tuning's is not: its modules import numpy and
dp_accounting, which ``dpsweep budget`` cannot afford and whose threads would keep the PRV
sandbox from forking; import it from its module.
"""

from orchestrator.accounting.cache import default_cache_dir
from orchestrator.accounting.calibration import DEFAULT_ACCOUNTANT_TIMEOUT_S, calibrate, certify
from orchestrator.accounting.certificate import WINDOW, Calibration, EpsilonBounds
from orchestrator.accounting.curve import epsilon_curve
from orchestrator.accounting.prv import prv_epsilon
from orchestrator.accounting.sandbox import keep_interpreters
from orchestrator.accounting.verify import (
    IndependentCheck,
    epsilon_of_events,
    rdp_epsilon,
    schedule_events,
    verify_calibration,
)

__all__ = [
    "DEFAULT_ACCOUNTANT_TIMEOUT_S",
    "WINDOW",
    "Calibration",
    "EpsilonBounds",
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
