"""The per-example gradient engine: norms and weighted sums from one forward + backward."""
