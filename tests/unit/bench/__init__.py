"""Unit tests of bench/ (the stock models' speed bench and its docs table)."""
