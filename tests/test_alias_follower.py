"""The alias follower against a real SQLite registry and a real gateway (the tiny model, in a
thread on loopback): each look serves what the aliases name, a canary's episodes are split
sticky, its feedback decides the live gate, and a champion failing on live feedback is rolled
back; the CLI's rollback returns to the champion before."""

from __future__ import annotations

import httpx
import mlflow
import openai
import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from lightning_core import semconv
from lightning_core.feedback import episode_headers, send_feedback
from lightning_core.stats.sequential import LiveGateConfig, RollbackConfig
from lightning_rl.flows.cli import app
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.follower import AliasFollower, version_name
from lightning_rl.registry.live import warm_start_alias
from lightning_rl.registry.live_config import LiveConfig
from lightning_rl.registry.names import (
    CHALLENGER,
    CHAMPION,
    TAG_DECISION,
    TAG_LIVE_DECISION,
    TAG_ROLLBACK_REASON,
)
from lightning_rl.registry.versions import champion_adapter
from tests.conftest import gateway_server
from tests.test_registry import make_adapter, register

MODEL = "follower-test"
HI = [{"role": "user", "content": "Hi."}]


@pytest.fixture
def registry(tmp_path, monkeypatch) -> RegistryConfig:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_registry_uri(uri)
    return RegistryConfig(tracking_uri=uri, registered_model=MODEL, live_gate=True)


def _alias(config: RegistryConfig, alias: str) -> str | None:
    client = MlflowClient(config.tracking_uri)
    try:
        return str(client.get_model_version_by_alias(MODEL, alias).version)
    except mlflow.exceptions.MlflowException:
        return None


def test_the_follower_serves_the_aliases_gates_the_canary_and_rolls_back(registry, tmp_path):
    adapter = make_adapter(tmp_path / "adapter")
    assert register(registry, adapter, "p1", 0.5).promote  # the first champion
    live = LiveConfig(
        canary_fraction=0.5,
        gate=LiveGateConfig(min_episodes=5),
        rollback=RollbackConfig(window=8, min_episodes=5, margin=0.1),
    )
    roots = {"adapter_roots": [str(tmp_path)]}
    with gateway_server(model="tiny", gateway_options=roots) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        follower = AliasFollower(
            registry, live, server.url, None, tmp_path / "adapters", server.model
        )

        def play(episodes: int, rewards: dict[str, float], prefix: str) -> dict[str, int]:
            served: dict[str, int] = {}
            for i in range(episodes):
                episode = f"{prefix}-{i}"
                for _turn in range(2):  # sticky: both calls of an episode on one version
                    reply = client.chat.completions.with_raw_response.create(
                        model="champion",
                        messages=HI,
                        max_tokens=2,
                        extra_headers=episode_headers(episode),
                    )
                    version = reply.headers[semconv.POLICY_VERSION_HEADER]
                    assert served.setdefault(episode, version) == version
                send_feedback(server.url, episode, rewards[version], source="user")
            return {v: list(served.values()).count(v) for v in set(served.values())}

        v1, v2, v3 = (version_name(MODEL, v) for v in "123")
        assert follower.follow().champion == v1
        assert play(3, {v1: 0.6}, "a") == {v1: 3}

        # v2 passes the offline gate: a canary, half the episodes, not the champion yet.
        decision = register(registry, adapter, "p2", 0.8)
        assert decision.canary and not decision.promote
        routing = follower.follow()
        assert (routing.champion, routing.challenger, routing.canary_fraction) == (v1, v2, 0.5)
        swaps = len(follower.swaps)
        assert not follower.gate()  # no feedback yet: it waits, and says so in the status
        assert follower.follow().status.startswith(f"live gate on {v2}: wait")
        assert len(follower.swaps) == swaps  # a new status alone is no swap
        split = play(16, {v1: 0.6, v2: 1.0}, "b")
        assert set(split) == {v1, v2}
        follower.step()  # the live gate: v2 better on feedback, promoted and served
        assert _alias(registry, CHAMPION) == "2"
        assert follower.follow().challenger is None
        assert follower.follow().champion == v2
        tags = MlflowClient(registry.tracking_uri).get_model_version(MODEL, "2").tags
        assert tags[TAG_LIVE_DECISION] == "promoted" and tags[TAG_DECISION] == "promoted"

        # v3 worse on live traffic: its canary ends, v2 stays.
        assert register(registry, adapter, "p3", 0.9).canary
        assert follower.follow().challenger == v3
        play(20, {v2: 1.0, v3: 0.0}, "c")
        follower.step()
        assert _alias(registry, CHAMPION) == "2" and _alias(registry, CHALLENGER) is None
        tags = MlflowClient(registry.tracking_uri).get_model_version(MODEL, "3").tags
        assert tags[TAG_DECISION] == "rejected"
        assert follower.follow().challenger is None

        # v2's live feedback collapses below v1's (0.6) by more than the margin: rolled back.
        play(8, {v2: 0.0}, "d")
        follower.step()
        assert _alias(registry, CHAMPION) == "1"
        assert follower.follow().champion == v1
        state = httpx.get(f"{server.url}/serving/routing").json()
        assert state["routing"]["status"].startswith(f"rolled back {v2}")
        counts = {row["policy_version"]: row["episodes"] for row in state["feedback"]}
        assert counts[v1] >= 3 and counts[v3] >= 1
        tags = MlflowClient(registry.tracking_uri).get_model_version(MODEL, "2").tags
        assert "below the previous champion" in tags[TAG_ROLLBACK_REASON]
        follower.http.close()

    # The CLI: nothing before v1 to return to, said in one line, exit 2.
    done = CliRunner().invoke(
        app,
        ["registry", "rollback", "--reason", "bad answers", "--tracking-uri",
         registry.tracking_uri, "--registered-model", MODEL],
    )  # fmt: skip
    assert done.exit_code == 2, done.output
    assert "first champion" in done.output and "Traceback" not in done.output


@pytest.mark.parametrize("options", ["[1]", "{threads: 1}"])
def test_production_refuses_backend_options_that_are_not_a_json_object(options):
    done = CliRunner().invoke(app, ["production", "--backend-options", options])
    assert done.exit_code == 2, done.output
    assert "--backend-options takes a JSON object" in done.output
    assert "Traceback" not in done.output


def test_a_challenger_warm_start_continues_the_canary_else_the_champion(registry, tmp_path):
    adapter = make_adapter(tmp_path / "adapter")
    assert register(registry, adapter, "p1", 0.5).promote
    assert warm_start_alias(registry, "challenger") == CHAMPION  # no canary: the champion
    assert register(registry, adapter, "p2", 0.8).canary
    assert warm_start_alias(registry, "challenger") == CHALLENGER
    assert warm_start_alias(registry, "champion") == CHAMPION
    found = champion_adapter(registry, CHALLENGER, dst=tmp_path / "warm")
    assert found is not None and found.version == "2"
