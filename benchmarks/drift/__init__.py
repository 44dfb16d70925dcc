"""The drift demonstration's parts (benchmarks/production_drift.py runs them)."""
