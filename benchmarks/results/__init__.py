"""The current benchmark figures (benchmarks/results.json) and the documents generated from them.

    .venv/bin/python -m benchmarks.results --update-docs   # rewrite the tables and quotes
    .venv/bin/python -m benchmarks.results --check         # exit 1 if a document is stale

A benchmark script calls `record(name, value)` where it printed `name: value`.
"""

from benchmarks.results.figures import (
    RESULTS,
    Figure,
    Results,
    ResultsError,
    dump,
    load,
    machine,
    record,
    record_printed,
)

__all__ = [
    "RESULTS",
    "Figure",
    "Results",
    "ResultsError",
    "dump",
    "load",
    "machine",
    "record",
    "record_printed",
]
