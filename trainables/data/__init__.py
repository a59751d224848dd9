"""Data: datasets from files or factories, and the four disjoint splits every trial uses."""
