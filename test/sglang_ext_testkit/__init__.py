"""Helpers for sglang-ext tests and benchmarks (imported by them only)."""
