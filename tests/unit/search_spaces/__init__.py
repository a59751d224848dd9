"""Unit tests of search_spaces/."""
