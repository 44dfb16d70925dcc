"""policy_per_agent end to end, in a real Prefect run: a two-agent system (tests/two_agents.py)
on the tiny model trains one LoRA adapter per agent; each agent's calls are served by its own
adapter, and the agents' adapters are evaluated, registered (one MLflow model version) and
promoted together."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import mlflow
import pytest
import torch
from mlflow import MlflowClient
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from lightning_core import semconv
from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.trainer import STATE_FILE, LoRATrainer
from lightning_core.errors import InvalidInput
from lightning_core.models import TINY_MODEL
from lightning_core.store import schema
from lightning_core.types import Transition
from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.names import TAG_AGENTS
from lightning_rl.registry.versions import champion_adapter
from lightning_rl.tasks.training import train_agent_policies

pytestmark = pytest.mark.timeout(600)

AGENT = "tests.two_agents:agent"
TASKS = "tests.two_agents:load_tasks"
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def trained(prefect_harness, tmp_path_factory):
    root = tmp_path_factory.mktemp("per-agent")
    config = RegistryConfig(
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        registered_model="per-agent-test",
        promotion_threshold=0.0,
    )
    state = train(
        agent=AGENT,
        tasks=TASKS,
        iterations=2,
        run_dir=str(root / "runs"),
        run_name="pa",
        train_agents=["a", "b"],
        policy_per_agent=True,
        registry=config,
        return_state=True,
        server={"model": "tiny"},
        rollouts={
            "tasks_per_iteration": 3,
            "group_size": 4,
            "sampling": {"temperature": 1.0},
            "rollout_workers": 2,
            "rollout_concurrency": 3,
        },
        evaluation={"eval_size": 3, "eval_every": 2},
    )
    assert state.is_completed(), state.message
    return state.result(), config, root / "runs" / "pa"


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / WEIGHTS)


def _differs(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    assert x.keys() == y.keys()
    return any(not torch.equal(x[k], y[k]) for k in x)


def test_each_agents_spans_name_its_own_policy_version(trained):
    summary, _, run = trained
    assert summary["policy_version"] == "pa-v2" and summary["policy_agents"] == ["a", "b"]
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT r.mode, r.policy_version, s.attributes FROM rollouts r "
            "JOIN spans s USING (rollout_id) WHERE s.name LIKE 'chat %'"
        ).fetchall()
    served = set()
    for mode, policy, attributes in rows:
        attributes = json.loads(attributes)
        agent, version = attributes[semconv.AGENT_NAME], attributes[semconv.POLICY_VERSION]
        assert attributes["gen_ai.request.model"] == policy
        # The base model serves both agents before the first update; then each its own adapter.
        assert version == (policy if policy == TINY_MODEL else f"{policy}-{agent}")
        served.add((mode, policy, agent, version))
    assert served == {
        ("train", TINY_MODEL, "a", TINY_MODEL),
        ("train", TINY_MODEL, "b", TINY_MODEL),
        ("train", "pa-v1", "a", "pa-v1-a"),
        ("train", "pa-v1", "b", "pa-v1-b"),
        ("test", TINY_MODEL, "a", TINY_MODEL),
        ("test", TINY_MODEL, "b", TINY_MODEL),
        # Evaluated together: the held-out rollouts on pa-v2 used both agents' adapters.
        ("test", "pa-v2", "a", "pa-v2-a"),
        ("test", "pa-v2", "b", "pa-v2-b"),
    }


def test_both_adapters_changed_from_their_initial_weights(trained):
    _, _, run = trained
    config = json.loads((run / "config.json").read_text())
    trainer_config = TrainerConfig.model_validate(config["trainer"]).model_copy(
        update={"model": "tiny", "seed": config["seed"]}
    )
    initial = {}
    for i, agent in enumerate(["a", "b"]):
        # What the flow's trainer of this agent started from (its seed is the run's + i).
        start = LoRATrainer(trainer_config.model_copy(update={"seed": config["seed"] + i}))
        initial[agent] = {k: v.detach() for k, v in get_peft_model_state_dict(start.model).items()}
    assert _differs(initial["a"], initial["b"])  # independent adapters from step 0
    for agent in ("a", "b"):
        v1, v2 = (_weights(run / "adapters" / v / agent) for v in ("v1", "v2"))
        assert _differs(initial[agent], v1) and _differs(v1, v2)


def test_each_agent_trains_on_its_own_calls(trained):
    summary, config, _ = trained
    client = MlflowClient(config.tracking_uri)
    run_id = summary["mlflow_run_id"]
    metric = client.get_run(run_id).data.metrics
    for agent in ("a", "b"):
        history = client.get_metric_history(run_id, f"train/{agent}/loss")
        assert sorted(m.step for m in history) == [1, 2]
    # One call per agent per rollout: the agents' transitions split the iteration's evenly.
    assert metric["train/a/transitions"] + metric["train/a/skipped_transitions"] == 12
    assert metric["train/b/transitions"] + metric["train/b/skipped_transitions"] == 12
    assert (
        metric["train/transitions"]
        == metric["train/a/transitions"] + (metric["train/b/transitions"])
    )


def test_an_agents_update_leaves_the_other_agents_adapter_untouched(trained, tmp_path):
    _, _, run = trained
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        cursor = con.execute("SELECT * FROM transitions WHERE policy_version = 'pa-v1-a'")
        columns = [d[0] for d in cursor.description]
        only_a = [Transition.model_validate(schema.row_dict(columns, r)) for r in cursor.fetchall()]
    assert only_a and all(t.agent_name == "a" for t in only_a)
    assert any(t.advantage for t in only_a)
    config = TrainerConfig(model="tiny", learning_rate=1e-2)
    configs = {a: config.model_copy(update={"seed": i}) for i, a in enumerate(("a", "b"))}

    metrics = train_agent_policies(
        configs, only_a, str(run / "adapters" / "v2"), str(tmp_path / "v3"), 1, 0
    )

    assert metrics["train/a/transitions"] > 0 and metrics["train/b/transitions"] == 0
    assert _differs(_weights(run / "adapters" / "v2" / "a"), _weights(tmp_path / "v3" / "a"))
    # b's adapter, as saved, is exactly what it was.
    assert not _differs(_weights(run / "adapters" / "v2" / "b"), _weights(tmp_path / "v3" / "b"))


def test_the_mlflow_version_holds_both_adapters_and_was_promoted_as_one(trained, tmp_path):
    summary, config, run = trained
    client = MlflowClient(config.tracking_uri)
    challenger = client.get_model_version_by_alias(config.registered_model, "challenger")
    assert challenger.tags["policy_version"] == "pa-v2"
    assert challenger.tags[TAG_AGENTS] == "a,b"
    # One decision for the version as a whole, on the score of the policy's evaluation.
    assert summary["promotion"]["promote"] and summary["promotion"]["challenger_version"] == "1"
    assert float(challenger.tags["eval.score"]) == summary["final"]["score"]

    found = champion_adapter(config, dst=tmp_path)
    assert found is not None and found.version == "1"
    assert sorted(p.name for p in found.adapter.iterdir()) == ["a", "b"]
    for agent in ("a", "b"):
        assert not (found.adapter / agent / STATE_FILE).exists()
        saved, registered = (
            _weights(run / "adapters" / "v2" / agent),
            _weights(found.adapter / agent),
        )
        assert not _differs(saved, registered)

    # The logged pyfunc answers with the adapter of the agent named at load time.
    uri = f"models:/{config.registered_model}/1"
    model = mlflow.pyfunc.load_model(uri, model_config={"agent": "b", "max_new_tokens": 3})
    loaded = get_peft_model_state_dict(model.unwrap_python_model().model)
    assert not _differs(_weights(run / "adapters" / "v2" / "b"), loaded)
    assert len(model.predict(["Hi"])) == 1


def test_the_evaluate_flow_serves_a_per_agent_champion_per_agent(trained, tmp_path):
    from lightning_rl.flows.evaluate import evaluate

    _, config, _ = trained
    result = evaluate(
        agent=AGENT,
        tasks=TASKS,
        policy="champion",
        eval_size=2,
        model="tiny",
        concurrency=2,
        run_dir=str(tmp_path),
        registry=config,
    )
    assert result["version"] == "1" and result["tasks"] == 2
    [folder] = tmp_path.glob("eval-*")
    with duckdb.connect(str(folder / "store.duckdb"), read_only=True) as con:
        spans = [json.loads(a) for (a,) in con.execute("SELECT attributes FROM spans").fetchall()]
    served = {
        (s[semconv.AGENT_NAME], s[semconv.POLICY_VERSION])
        for s in spans
        if "gen_ai.request.model" in s
    }
    assert served == {("a", "per-agent-test-v1-a"), ("b", "per-agent-test-v1-b")}


def test_policy_per_agent_needs_the_agents_named(prefect_harness, tmp_path):
    with pytest.raises(InvalidInput, match="train_agents"):
        train(
            agent=AGENT,
            tasks=TASKS,
            policy_per_agent=True,
            run_dir=str(tmp_path),
            run_name="unnamed",
            server={"model": "tiny"},
        )
    # Refused before anything started: no run folder, no policy server.
    assert not (tmp_path / "unnamed").exists()
