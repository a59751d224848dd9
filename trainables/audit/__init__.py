"""The audit's model side: reference models, per-example signals, calibrated scores,
canaries and the per-layer attacks (LiRA / RMIA family); each module is imported by name."""
