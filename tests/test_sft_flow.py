"""warm_start=sft in a real training run (slow): a real Prefect run, the (scaled) tiny model on
the one-token bandit, whose reward is 1 when the reply is TARGET. TARGET is the base model's
second likeliest reply, so greedy decoding of the base model never gives it; the sampled
episodes that did are kept, an adapter is fine-tuned on them and published as policy v0, and
the held-out evaluation of v0 (greedy, iteration 0) now answers TARGET. RL continues from it."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig
from tests import flow_agents
from tests.models import likeliest_replies, scaled_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _second_likeliest(model_dir) -> str:
    replies = likeliest_replies(model_dir, flow_agents.BANDIT_QUESTION, 10)
    texts = [text for _, text in replies]
    for p, text in replies[1:]:
        if p >= 0.03 and text.strip() and texts.count(text) == 1 and text != texts[0]:
            return text
    raise AssertionError(f"no second token to target among {texts}")


def test_a_supervised_warm_start_turns_sampled_successes_into_policy_v0(
    prefect_harness, tmp_path, monkeypatch
):
    model = scaled_tiny_model(tmp_path / "sharp", 20)
    monkeypatch.setattr(flow_agents, "TARGET", _second_likeliest(model))
    registry = RegistryConfig(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", registered_model="sft-test"
    )
    state = train(
        agent="tests.flow_agents:bandit_agent",
        tasks="tests.flow_agents:bandit_tasks",
        iterations=1,
        warm_start="sft",
        sft={"tasks": 8, "samples_per_task": 8, "epochs": 3, "updates_per_epoch": 2},
        trainer={"learning_rate": 1e-2, "lora": {"rank": 8, "alpha": 32}},
        run_dir=str(tmp_path / "runs"),
        run_name="sft",
        registry=registry,
        server={"model": str(model)},
        rollouts={"tasks_per_iteration": 4, "group_size": 4, "sampling": {"temperature": 1.0}},
        evaluation={"eval_size": 4, "eval_every": 1},
        return_state=True,
    )
    state.result()
    checkpoint = json.loads((tmp_path / "runs" / "sft" / "checkpoint.json").read_text())
    [start, first] = checkpoint["evaluations"]
    # v0 is the fine-tuned adapter, and greedy decoding now gives what the base model's did
    # not (TARGET is its second choice).
    assert start["iteration"] == 0 and start["result"]["policy_version"] == "sft-v0"
    assert start["result"]["score"] == 1.0
    assert first["iteration"] == 1
    client = MlflowClient(registry.tracking_uri)
    [run] = client.search_runs(client.get_experiment_by_name(registry.experiment).experiment_id)
    metrics = run.data.metrics
    assert 0 < metrics["sft/successes"] < metrics["sft/episodes"] == 64
    assert metrics["sft/last_loss"] < metrics["sft/first_loss"]
    assert run.data.tags["warm_start"].startswith("sft (")
