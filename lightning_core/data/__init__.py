"""Training data: spans to transitions (adapter), credit-assigned batches (collect),
DuckDB analytics, task tables, offline episodes, and files written whole or not at all."""
