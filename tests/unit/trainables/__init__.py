"""Unit tests of trainables/."""
