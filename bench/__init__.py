"""Serving and kernel benchmarks."""
