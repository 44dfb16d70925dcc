"""Concurrent rollouts and training (TrainConfig.staleness, flows/pipeline.py).

The producer's bound and hand-over in plain Python; then, in a real Prefect run with a tiny
model, a real policy server and MLflow on SQLite, that with staleness=1 iteration k+1's
rollouts run while iteration k trains (the spans' policy versions and times, and the training
interval from the run's progress file and the store's publish times), and that the run still
learns: the toy bandit's reward rises.
"""

from __future__ import annotations

import json
import os
import threading
import time
from unittest import mock

import duckdb
import pytest
from mlflow import MlflowClient

from lightning_core.algo.trainer import LoRATrainer
from lightning_core.data.collect import Collected
from lightning_core.types import Transition
from lightning_rl.flows import pipeline
from lightning_rl.flows.config import TrainConfig
from lightning_rl.registry.config import RegistryConfig
from tests import flow_agents
from tests.models import likeliest_replies, scaled_tiny_model


def _batch(policy: str) -> pipeline.Batch:
    return pipeline.Batch(Collected(), {}, {}, policy, time.time(), time.time())


def _producer(staleness: int, last: int = 4, fail_at: int | None = None):
    sampled: list[tuple[int, str]] = []
    started = {j: threading.Event() for j in range(1, last + 1)}

    def collect(j: int, policy: str) -> pipeline.Batch:
        started[j].set()
        if j == fail_at:
            raise RuntimeError(f"rollouts of {j} failed")
        sampled.append((j, policy))
        return _batch(policy)

    ahead = pipeline.RolloutsAhead("r", collect, 1, last, "base", staleness)
    return ahead, sampled, started


def test_with_staleness_1_the_next_batch_is_sampled_before_the_update_and_then_waits():
    ahead, sampled, started = _producer(staleness=1)
    with ahead:
        assert started[2].wait(5)  # batch 2 did not wait for version 1
        batch, _ = ahead.take(1)
        assert batch.policy == "base"
        # Batch 3 needs version 1 (at most 1 behind version 2, which iteration 3 trains).
        assert not started[3].wait(0.3)
        ahead.published(1, "r-v1")
        assert started[3].wait(5)
        assert not started[4].wait(0.3)
        ahead.published(2, "r-v2")
        assert ahead.take(4)[0].policy == "r-v2"
    assert sampled == [(1, "base"), (2, "base"), (3, "r-v1"), (4, "r-v2")]
    with pytest.raises(RuntimeError, match="taken already"):
        ahead.take(4)
    assert pipeline.running() is None


def test_with_staleness_0_each_batch_waits_for_the_previous_version():
    ahead, _, started = _producer(staleness=0, last=2)
    with ahead:
        assert ahead.take(1)[0].policy == "base"
        assert not started[2].wait(0.3)
        ahead.published(1, "r-v1")
        assert ahead.take(2)[0].policy == "r-v1"


def test_a_failed_batch_fails_its_iteration_and_the_later_ones():
    ahead, _, _ = _producer(staleness=2, fail_at=2)
    with ahead:
        assert ahead.take(1)[0].policy == "base"
        for j in (2, 3):
            with pytest.raises(RuntimeError, match="rollouts of 2 failed"):
                ahead.take(j)


def test_a_stopped_run_stops_its_producer_at_the_bound():
    ahead, sampled, _ = _producer(staleness=0, last=3)
    with ahead:
        ahead.take(1)
    assert not ahead._thread.is_alive() and sampled == [(1, "base")]


def test_staleness_is_counted_in_versions_behind_the_trained_policy():
    def t(version: str | None) -> Transition:
        return Transition(
            rollout_id="ro",
            step=0,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[-1.0],
            reward=1.0,
            advantage=1.0,
            policy_version=version,
        )

    assert pipeline.PolicyRef(run="run", index=3).name() == "run-v3"
    assert pipeline.PolicyRef(run="run", index=3).name("writer") == "run-v3-writer"
    found = pipeline.staleness_metrics(
        Collected(transitions=[t("run-v1"), t("run-v2"), t("run-v2")]), 2, "run"
    )
    assert found == {"train/staleness_mean": pytest.approx(1 / 3), "train/staleness_max": 1.0}
    # An agent's own version counts as its iteration's; the base model, or another run's
    # version, as v0.
    agents = pipeline.staleness_metrics(
        Collected(transitions=[t("run-v3-writer"), t("base-model"), t("other-v3")]),
        3,
        "run",
        ["writer"],
    )
    assert agents == {"train/staleness_mean": pytest.approx(2.0), "train/staleness_max": 3.0}


def test_staleness_turns_truncated_importance_sampling_on_unless_set():
    assert TrainConfig().trainer.tis_cap is None
    assert TrainConfig(staleness=1).trainer.tis_cap == 2.0
    assert TrainConfig(staleness=1, trainer={"tis_cap": 5.0}).trainer.tis_cap == 5.0
    with pytest.raises(ValueError, match="staleness=0"):
        TrainConfig(staleness=1, data="episodes", episodes_from="http://127.0.0.1:1")


# ---------------------------------------------------------------------------- end to end


def _bandit_target(model_dir) -> str:
    """The likeliest one-token reply the untrained model gives with p between 5 % and 35 %:
    the reward starts low and has room to rise."""
    replies = likeliest_replies(model_dir, flow_agents.BANDIT_QUESTION)
    texts = [text for _, text in replies]
    for p, text in replies:
        if 0.05 <= p <= 0.35 and text.strip() and texts.count(text) == 1:
            return text
    raise AssertionError(f"no token to target among {replies}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_staleness_1_overlaps_rollouts_with_training_slowed_to_4s_and_still_learns(
    prefect_test_server, tmp_path, monkeypatch
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    from lightning_rl.flows.train import train
    from tests.conftest import use_prefect_server

    # The tiny model's update takes milliseconds, less than starting a subflow run: slowed to
    # the seconds a real model's takes, so that there is a training interval to overlap.
    step = LoRATrainer.step

    def slow_step(self, *args, **kwargs):
        time.sleep(4)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(LoRATrainer, "step", slow_step)
    model = scaled_tiny_model(tmp_path / "sharp", 20)
    monkeypatch.setattr(flow_agents, "TARGET", _bandit_target(model))
    registry = RegistryConfig(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        registered_model="staleness-test",
        promotion_threshold=0.0,
    )
    iterations = 8
    with use_prefect_server(prefect_test_server):
        state = train(
            agent="tests.flow_agents:bandit_agent",
            tasks="tests.flow_agents:bandit_tasks",
            iterations=iterations,
            trainer={"learning_rate": 1e-2, "lora": {"rank": 8, "alpha": 32}},
            run_dir=str(tmp_path / "runs"),
            run_name="st",
            registry=registry,
            server={"model": str(model)},
            rollouts={
                "tasks_per_iteration": 8,
                "group_size": 8,
                "sampling": {"temperature": 1.0},
                "rollout_workers": 2,
                "rollout_concurrency": 8,
                "staleness": 1,
            },
            evaluation={"eval_size": 4, "eval_every": iterations},
            return_state=True,
        )
        summary = state.result()
        # The server is shared with other tests' runs: only this run's subflow runs are read.
        parent = state.state_details.flow_run_id
        with get_client(sync_client=True) as client:
            flow_runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])
                )
            )
    # Each batch was a subflow run of the train run, like the iterations.
    names = {r.name: r for r in flow_runs}
    for k in range(1, iterations + 1):
        for child in (names[f"rollouts-{k}"], names[f"iteration-{k}"]):
            assert child.state.is_completed() and child.parent_task_run_id is not None
            assert child.id != parent
    run = tmp_path / "runs" / "st"
    checkpoint = json.loads((run / "checkpoint.json").read_text())
    history = {int(m["iteration"]): m for m in checkpoint["history"]}
    events = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    trains = {e["iteration"]: e["time"] for e in events if e["stage"] == "training"}
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        published = dict(con.execute("SELECT name, created_at FROM policy_versions").fetchall())
        calls = con.execute(
            "SELECT r.group_id, t.policy_version, s.start_time, s.end_time FROM transitions t "
            "JOIN rollouts r USING (rollout_id) JOIN spans s USING (rollout_id) "
            "WHERE s.name LIKE 'chat %' AND r.mode = 'train'"
        ).fetchall()
    by_iteration: dict[int, list[tuple[str, float, float]]] = {}
    for group, version, start, end in calls:
        it = int(group.split("-it")[1].split("-")[0])
        by_iteration.setdefault(it, []).append((version, start, end))
    rewards = [history[k]["rollout/reward_mean"] for k in range(1, iterations + 1)]
    print("bandit reward per iteration (staleness 1):", [round(r, 2) for r in rewards])
    overlapped = []
    for k in range(1, iterations):
        # Iteration k made v<k> after v<k-1> was published; its update ran from its
        # "training" event until v<k> was published.
        made_from = published[f"st-v{k - 1}"] if k > 1 else 0.0
        train_start, train_end = trains[k], published[f"st-v{k}"]
        behind = f"st-v{k - 1}" if k > 1 else summary["base"]["policy_version"]
        nxt = by_iteration[k + 1]
        # Iteration k+1's rollouts were sampled by v<k-1>, one version behind v<k>, which
        # iteration k+1 trained from. The producer takes the newest published policy, so it
        # chose theirs before v<k> existed: they did not wait for iteration k (at staleness 0
        # they could only start after it). When their first call went out also depends on
        # how long a subflow takes to start on a busy machine, which can outlast an update,
        # so the overlap in time is asserted below over the run, not for each iteration.
        assert {v for v, *_ in nxt} == {behind}, (k, {v for v, *_ in nxt})
        first = min(s for _, s, _ in nxt)
        assert made_from <= first, (k, made_from, first)
        print(
            f"iteration {k}: trained {train_end - train_start:.1f} s, next calls at "
            f"{first - train_start:+.1f} s"
        )
        assert history[k + 1]["train/staleness_max"] == 1.0
        # Most batches (64 one-token calls) run inside the update itself; on a busy machine
        # some finish before it starts.
        if history[k]["train/transitions"] and any(
            s < train_end and e > train_start for _, s, e in nxt
        ):
            overlapped.append(k)
    assert history[1]["train/staleness_max"] == 0.0
    assert len(overlapped) >= 2, overlapped
    # It learns: the last iterations' reward well above the first ones'.
    assert sum(rewards[-2:]) / 2 >= sum(rewards[:2]) / 2 + 0.3, rewards
    assert any(history[k]["train/is_ratio_max"] > 1.0 for k in range(2, iterations + 1))
    client = MlflowClient(registry.tracking_uri)
    logged = client.get_metric_history(summary["mlflow_run_id"], "train/staleness_mean")
    assert sorted(m.step for m in logged) == list(range(1, iterations + 1))


@pytest.fixture
def omp_unset():
    """OMP_WAIT_POLICY unset, and the whole environment as it was afterwards: _passive_openmp
    writes os.environ itself, which a later monkeypatch.delenv would record and put back."""
    with mock.patch.dict(os.environ):
        os.environ.pop("OMP_WAIT_POLICY", None)
        yield


@pytest.mark.parametrize(
    ("argv", "passive"),
    [
        (["train", "--agent", "calc"], False),
        (["train", "--staleness", "0"], False),
        (["train", "--staleness", "1"], True),
        (["train", "--staleness=2", "--backend", "transformers"], True),
        (["train", "--staleness", "1", "--backend", "vllm"], False),
        (["eval", "--staleness", "1"], False),
    ],
)
def test_overlapping_on_cpu_makes_openmp_wait_passively_before_torch_loads(
    argv, passive, omp_unset
):
    from lightning_rl.flows.cli.openmp import passive_openmp as _passive_openmp
    from lightning_rl.flows.run_start import server_env as _server_env

    _passive_openmp(argv)
    assert (os.environ.get("OMP_WAIT_POLICY") == "PASSIVE") is passive
    os.environ.pop("OMP_WAIT_POLICY", None)
    server = _server_env(TrainConfig(staleness=1))
    assert server == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert _server_env(TrainConfig()) == {} == _server_env(TrainConfig(staleness=1, backend="vllm"))
    # A user's own setting wins.
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    _passive_openmp(["train", "--staleness", "1"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and _server_env(TrainConfig(staleness=1)) == {}


@pytest.mark.parametrize(
    ("extra", "passive"),
    [
        ([], True),
        (["--staleness", "0"], False),  # the flag wins over the file
        (["--preset", "gpu"], False),  # vLLM: the file keeps the preset's backend
        (["--preset", "gpu", "--backend", "transformers"], True),
        (["--resume", "old"], True),
    ],
)
def test_a_staleness_from_the_config_file_or_the_resumed_run_also_makes_openmp_passive(
    tmp_path, omp_unset, extra, passive
):
    from lightning_rl.flows.cli.openmp import passive_openmp as _passive_openmp

    config = tmp_path / "overlap.json"
    config.write_text(json.dumps({"staleness": 2, "run_dir": str(tmp_path / "runs")}))
    _passive_openmp(["train", "--config", str(config), *extra])
    assert (os.environ.get("OMP_WAIT_POLICY") == "PASSIVE") is passive
    # A resumed run keeps its own staleness; an unreadable --config is left to the command.
    os.environ.pop("OMP_WAIT_POLICY", None)
    old = tmp_path / "runs" / "old"
    old.mkdir(parents=True)
    (old / "config.json").write_text(json.dumps({"staleness": 1}))
    _passive_openmp(["train", "--resume", "old", "--run-dir", str(tmp_path / "runs")])
    assert os.environ.pop("OMP_WAIT_POLICY") == "PASSIVE"
    _passive_openmp(["train", "--config", str(tmp_path / "missing.json")])
    assert "OMP_WAIT_POLICY" not in os.environ
