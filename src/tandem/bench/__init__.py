"""Benchmarks that measure tandem against a baseline run in the same process."""
