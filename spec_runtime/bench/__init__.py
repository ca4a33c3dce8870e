"""Benchmark-only machinery, imported only when a benchmark asks for it."""
