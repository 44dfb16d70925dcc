"""lightning-rl's framework: data model, store, gateway, tracing, credit assignment, training.

Plain Python and torch: nothing here imports Prefect or MLflow.
"""

__version__ = "0.1.0"
