"""search_spaces."""
