"""A training run whose policy server silently stops loading new adapters stops at the probe
(slow): a real Prefect run, tiny model, real policy server in its own process. The server's
fault is injected from outside the product: a `sitecustomize` on its PYTHONPATH makes every
adapter load after the first load the first adapter's folder again, the way a LoRA sync that
stopped keeps the old weights under each new name."""

from __future__ import annotations

import json

import pytest

from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STALE_LOADS = """
from lightning_core.backends.transformers_backend import backend as _backend

_load = _backend.TransformersBackend.load_adapter
_first = []


async def load_adapter(self, name, path):
    _first.append(path)
    await _load(self, name, _first[0])


_backend.TransformersBackend.load_adapter = load_adapter
"""


def test_a_server_that_keeps_the_old_weights_stops_the_run_at_the_probe(
    prefect_harness, tmp_path, monkeypatch
):
    (tmp_path / "inject" / "sitecustomize.py").parent.mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(STALE_LOADS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "inject"))
    state = train(
        agent="tests.flow_agents:agent",
        tasks="tests.flow_agents:load_tasks",
        iterations=3,
        run_dir=str(tmp_path / "runs"),
        run_name="stale",
        registry=RegistryConfig(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", registered_model="stale-test"
        ),
        return_state=True,
        server={"model": "tiny"},
        rollouts={"tasks_per_iteration": 3, "group_size": 4, "sampling": {"temperature": 1.0}},
        evaluation={"eval_size": 3, "eval_every": 10},
    )
    assert state.is_failed(), state.message
    with pytest.raises(Exception, match=r"'stale-v2' answers the probe exactly as 'stale-v1'"):
        state.result()
    # Stopped at the check: iteration 1 completed, iteration 2 published and was caught
    # before its checkpoint, and no iteration began sampling from the stale version.
    checkpoint = json.loads((tmp_path / "runs" / "stale" / "checkpoint.json").read_text())
    assert checkpoint["iteration"] == 1
    events = [
        json.loads(line)
        for line in (tmp_path / "runs" / "stale" / "progress.jsonl").read_text().splitlines()
    ]
    assert [e["iteration"] for e in events if e["stage"] == "iteration"] == [1, 2]
