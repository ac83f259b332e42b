"""Benchmarks that need a GPU. Timings live here, never in tests."""
