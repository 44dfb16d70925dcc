"""One policy per agent, below the flow: the store keeps a version's agent map, publish_policy
turns a folder of per-agent adapters into versions, and the gateway serves each agent's calls
with its own adapter, chosen by the agent name the call carries, and records that version."""

from __future__ import annotations

from pathlib import Path

import duckdb
import httpx
import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lightning_core import semconv
from lightning_core.algo.trainer import STATE_FILE, agent_adapter_dirs
from lightning_core.app import create_app
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.errors import Conflict
from lightning_core.gateway.service import Gateway, GatewayConfig
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import PolicyVersion
from lightning_rl.tasks.training import publish_policy
from tests.conftest import ThreadedServer
from tests.models import scaled_tiny_model

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _adapter(model_dir: Path, folder: Path, seed: int) -> Path:
    # Random (not zero) LoRA weights: each adapter visibly changes the model's answers.
    torch.manual_seed(seed)
    config = LoraConfig(r=4, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(folder)
    (folder / STATE_FILE).write_bytes(b"optimizer state")  # as LoRATrainer.save leaves it
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # Scaled: greedy answers and logprobs differ clearly between adapters.
    return scaled_tiny_model(tmp_path_factory.mktemp("tiny-varied"), 10)


@pytest.fixture(scope="module")
def policy_dir(model_dir, tmp_path_factory) -> Path:
    """A policy saved one adapter per agent: <policy>/a/, <policy>/b/."""
    root = tmp_path_factory.mktemp("policy")
    _adapter(model_dir, root / "a", seed=1)
    _adapter(model_dir, root / "b", seed=2)
    return root


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    store = DuckDBStore(db=":memory:")
    backend = TransformersBackend(model=str(model_dir), device="cpu")
    # Adapters load from the tests' own folders only (adapter_folder.py).
    config = GatewayConfig(adapter_roots=[str(tmp_path_factory.getbasetemp())])
    with ThreadedServer(create_app(store, gateway=Gateway(backend, store, config))) as running:
        running.model = backend.base_model
        yield running


@pytest.fixture(scope="module")
def published(server, policy_dir) -> str:
    # .fn: the task's body, without a Prefect run around it.
    name = publish_policy.fn(server.url, "p-v1", server.model, str(policy_dir), 1)
    # A retry after a lost response publishes nothing twice and fails nothing.
    assert publish_policy.fn(server.url, "p-v1", server.model, str(policy_dir), 1) == name
    return name


@pytest.fixture
def attempt(server) -> tuple[str, str]:
    """A claimed rollout attempt: (its OpenAI base URL, rollout id)."""
    with httpx.Client(base_url=server.url) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    rollout_id, attempt_id = rollout["rollout_id"], claim["attempt"]["attempt_id"]
    return f"{server.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1", rollout_id


def _call(base_url: str, model: str, agent: str | None = None) -> list[float]:
    """Logprobs of a greedy answer of `model`, called as `agent`."""
    headers = {semconv.AGENT_HEADER: agent} if agent else None
    api = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, default_headers=headers)
    reply = api.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True
    )
    return [t.logprob for t in reply.choices[0].logprobs.content]


def _call_spans(server, rollout_id: str) -> list[dict]:
    with httpx.Client(base_url=server.url) as http:
        spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    return [s["attributes"] for s in spans if semconv.PROMPT_TOKEN_IDS in s["attributes"]]


def test_the_policy_folder_layout_is_read_back_per_agent(policy_dir):
    assert agent_adapter_dirs(policy_dir) == {"a": policy_dir / "a", "b": policy_dir / "b"}
    # A single adapter's folder is shared by every agent; a missing folder has no agents.
    assert agent_adapter_dirs(policy_dir / "a") == {}
    assert agent_adapter_dirs(policy_dir / "missing") == {}


def test_publishing_a_per_agent_folder_registers_a_version_per_agent(server, published, policy_dir):
    with httpx.Client(base_url=server.url) as http:
        versions = {v["name"]: v for v in http.get("/store/policy-versions").json()}
    assert published == "p-v1"
    assert versions["p-v1"]["agent_policies"] == {"a": "p-v1-a", "b": "p-v1-b"}
    assert versions["p-v1"]["adapter_path"] is None  # no shared adapter: others get the base
    assert versions["p-v1-a"]["adapter_path"] == str(policy_dir.resolve() / "a")
    assert versions["p-v1-b"]["adapter_path"] == str(policy_dir.resolve() / "b")
    # Publishing the same name with other adapters is still a conflict.
    with pytest.raises(Conflict):
        publish_policy.fn(server.url, "p-v1", server.model, str(policy_dir / "a"), 1)


def test_each_agent_is_served_by_its_own_adapter_and_its_span_names_it(server, published, attempt):
    base_url, rollout_id = attempt
    own_a, own_b = _call(base_url, "p-v1-a"), _call(base_url, "p-v1-b")
    as_a, as_b = _call(base_url, published, "a"), _call(base_url, published, "b")
    unnamed, other = _call(base_url, published), _call(base_url, published, "c")
    base = _call(base_url, server.model)

    # Served by the agent's own adapter: the same distribution as calling it directly...
    assert as_a == pytest.approx(own_a, abs=1e-5)
    assert as_b == pytest.approx(own_b, abs=1e-5)
    # ...and not the other agent's, nor the base model's.
    assert as_a != pytest.approx(as_b, abs=1e-3)
    assert as_b != pytest.approx(base, abs=1e-3)
    # Agents without an adapter of their own get this version's (none: the base model).
    assert unnamed == pytest.approx(base, abs=1e-5) and other == pytest.approx(base, abs=1e-5)

    spans = _call_spans(server, rollout_id)
    served = [(s["gen_ai.request.model"], s[semconv.POLICY_VERSION]) for s in spans]
    assert served == [
        ("p-v1-a", "p-v1-a"),
        ("p-v1-b", "p-v1-b"),
        (published, "p-v1-a"),
        (published, "p-v1-b"),
        (published, server.model),
        (published, server.model),
        (server.model, server.model),
    ]
    assert [s.get(semconv.AGENT_NAME) for s in spans[2:6]] == ["a", "b", None, "c"]


def test_text_completions_are_served_per_agent_too(server, published, attempt):
    base_url, rollout_id = attempt
    with httpx.Client(base_url=base_url) as http:
        for agent in ("b", "c"):
            reply = http.post(
                "/completions",
                json={"model": published, "prompt": "Hello", "max_tokens": 3},
                headers={semconv.AGENT_HEADER: agent},
            )
            assert reply.status_code == 200, reply.text
    assert [s[semconv.POLICY_VERSION] for s in _call_spans(server, rollout_id)] == [
        "p-v1-b",
        server.model,
    ]


def test_a_shared_adapter_serves_the_agents_without_their_own(server, published, attempt):
    with httpx.Client(base_url=server.url) as http:
        # b's adapter as the shared one, and a's own for agent a.
        shared = {
            "name": "q-v1",
            "base_model": server.model,
            "adapter_path": http.get("/store/policy-versions/p-v1-b").json()["adapter_path"],
            "agent_policies": {"a": "p-v1-a", "z": "nowhere"},
        }
        http.post("/store/policy-versions", json=shared).raise_for_status()
    base_url, rollout_id = attempt
    assert _call(base_url, "q-v1", "c") == pytest.approx(_call(base_url, "p-v1-b"), abs=1e-5)
    assert _call(base_url, "q-v1", "a") == pytest.approx(_call(base_url, "p-v1-a"), abs=1e-5)
    versions = [s[semconv.POLICY_VERSION] for s in _call_spans(server, rollout_id)]
    assert versions == ["q-v1", "p-v1-b", "p-v1-a", "p-v1-a"]
    # An agent mapped to a version that does not exist is refused, naming that version.
    api = openai.OpenAI(
        base_url=base_url,
        api_key="-",
        max_retries=0,
        default_headers={semconv.AGENT_HEADER: "z"},
    )
    with pytest.raises(openai.NotFoundError, match="nowhere"):
        api.chat.completions.create(model="q-v1", messages=MESSAGES, max_tokens=2)


async def test_agent_policies_persist_and_older_stores_migrate(tmp_path):
    db = tmp_path / "store.duckdb"
    # A store file from before agent_policies: its policy_versions table lacks the column.
    with duckdb.connect(str(db)) as con:
        con.execute(
            "CREATE TABLE policy_versions (name VARCHAR, base_model VARCHAR, "
            "adapter_path VARCHAR, created_at DOUBLE, metadata JSON)"
        )
        con.execute("INSERT INTO policy_versions VALUES ('old', 'm', '/x', 1.0, '{}')")
    store = DuckDBStore(db=str(db))
    try:
        assert (await store.get_policy_version("old")).agent_policies == {}
        await store.add_policy_version(
            PolicyVersion(name="new", base_model="m", agent_policies={"a": "new-a"})
        )
    finally:
        await store.close()
    reopened = DuckDBStore(db=str(db))
    try:
        assert (await reopened.get_policy_version("new")).agent_policies == {"a": "new-a"}
        assert (await reopened.get_policy_version("old")).adapter_path == "/x"
    finally:
        await reopened.close()
