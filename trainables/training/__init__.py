"""The training loop one trial runs, and where its data and GPU share live."""
