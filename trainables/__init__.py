"""trainables."""
