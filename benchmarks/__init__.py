"""Benchmark suites (not part of the installed package)."""
