"""Benchmarks: each suite prints its figures and the ratio to peers measured in the same run."""
