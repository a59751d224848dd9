"""The generated blocks of README.md and docs/ (``python -m bench.docgen`` rewrites them):
tables from the code's declarations and from ``bench/results``. Outside the wheel: it reads
the repository, which an installed dpsweep does not have."""
