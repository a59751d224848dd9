"""The privacy cost of tuning: ``private`` (Papernot & Steinke's random search, its end-to-end
bound, the secret trial count, the noisy score) and ``adaptive`` (what an adaptive sweep's
epsilons cover, given what its sampler saw).

Nothing is re-exported: both modules import numpy and dp_accounting, which ``dpsweep budget``
cannot afford and whose threads would keep the PRV sandbox from forking; import from the module.
"""
