"""The DP step and what it is made of: the update, the secret randomness, the spectral tail."""
