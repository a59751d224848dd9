"""System tests: whole sweeps, faults and clusters, end to end."""
