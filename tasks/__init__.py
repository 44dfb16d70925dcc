"""Thin Prefect tasks over lightning_core: retries, timeouts, tags and artifacts live here."""
