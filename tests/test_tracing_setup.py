"""Rollout workers that set tracing up at the same moment share one live provider (issue 25,
item 10): a resumed run's first iteration printed "spans of attempt ... were not all flushed"
16 times, because its two run-rollouts threads each made a provider and the second shut the
first one down; the first worker's spans were dropped."""

from __future__ import annotations

import threading

from lightning_core import tracing
from lightning_core.rollouts import runner
from lightning_core.store.client import HttpStoreClient


def test_rollout_workers_setting_tracing_up_at_once_share_one_live_provider(monkeypatch):
    """Eight threads ask for tracing at once, as the first iteration's rollout workers of a
    resumed run do: each gets the same provider, and it flushes."""
    monkeypatch.setattr(runner, "_traced_target", None)
    monkeypatch.setattr(runner, "_traced_provider", None)
    monkeypatch.setattr(tracing, "_provider", None)
    store = HttpStoreClient("http://127.0.0.1:9", api_key="key")
    start = threading.Barrier(8)
    providers = []

    def worker() -> None:
        start.wait()
        providers.append(runner.ensure_tracing(store))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len({id(p) for p in providers}) == 1
        assert providers[0].force_flush(1000)  # False once shut down
    finally:
        providers[0].shutdown()
