"""Prefect flows that compose the tasks into the training pipeline."""
