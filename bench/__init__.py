"""Benchmarks: `tightrope bench` (figures are printed and saved, never asserted in unit tests)."""
