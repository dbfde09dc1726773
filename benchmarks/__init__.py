"""Benchmarks of swe_flush_sync against the one-by-one async hook and its best peers."""
