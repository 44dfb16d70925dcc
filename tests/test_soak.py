"""A short run of the soak (benchmarks/soak.py), so that it keeps working between full runs."""

from __future__ import annotations

import os

from benchmarks.soak import report, soak
from tests.conftest import gateway_server


async def test_a_short_soak_runs_every_kind_of_request_without_an_error():
    with gateway_server(model="tiny") as server:
        result = await soak(server.url, clients=8, seconds=3, warmup=1, pid=os.getpid())
    text = report(result)
    assert result.tally.error_count == 0, text
    for kind in ("enqueue", "dequeue", "chat_rollout", "add_spans", "complete", "query_spans"):
        assert result.tally.latencies[kind], (kind, text)
    assert f"soak_requests: {result.tally.requests}" in text and "soak_errors: 0" in text
    assert "soak_rss_growth_pct: " in text
