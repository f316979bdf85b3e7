"""Benchmarks: each runs the baseline and kvswarm in one run on the same data and prints the ratio."""
