"""Which policy produced every token (lightning_core/provenance.py, tasks/provenance.py): the
hashes and fingerprint are content hashes; a real gateway (tiny model, loopback) puts them on
every call's span; a folder rewritten after its publish is refused; a publish whose load is
skipped is caught by the probe; and collecting refuses rollouts that disagree with the run's
record, counted per reason and in the analytics export."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.data import analytics
from lightning_core.data import provenance as checks
from lightning_core.data.collect import collect
from lightning_core.data.provenance import ProbeAnswer, ProvenanceConfig, ProvenanceRecord
from lightning_core.errors import PolicyNotServed
from lightning_core.gateway.service import Gateway, GatewayConfig
from lightning_core.security import provenance
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import Rollout, Transition
from lightning_rl.tasks.provenance import probe_served_policy
from lightning_rl.tasks.training import publish_policy
from tests.conftest import ThreadedServer
from tests.models import scaled_tiny_model

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _adapter(model_dir: Path, folder: Path, seed: int) -> Path:
    # Random (not zero) LoRA weights: each adapter visibly changes the model's answers.
    torch.manual_seed(seed)
    config = LoraConfig(r=4, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return scaled_tiny_model(tmp_path_factory.mktemp("tiny-varied"), 10)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [_adapter(model_dir, root / f"a{seed}", seed) for seed in (1, 2, 3)]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    store = DuckDBStore(db=":memory:")
    backend = TransformersBackend(model=str(model_dir), device="cpu")
    config = GatewayConfig(adapter_roots=[str(tmp_path_factory.getbasetemp())])
    gateway = Gateway(backend, store, config)
    with ThreadedServer(create_app(store, gateway=gateway)) as running:
        running.model = backend.base_model
        running.gateway = gateway
        yield running


def _attempt(server) -> tuple[str, Rollout]:
    """A claimed rollout attempt: its OpenAI base URL, and the rollout."""
    with httpx.Client(base_url=server.url) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    attempt_id = claim["attempt"]["attempt_id"]
    base_url = f"{server.url}/rollouts/{rollout['rollout_id']}/attempts/{attempt_id}/v1"
    return base_url, Rollout.model_validate(rollout)


def _chat(base_url: str, model: str) -> None:
    api = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
    api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)


async def _finish(server, rollout: Rollout) -> tuple[list[Rollout], list]:
    """Complete the rollout (reward 1) and read it and its spans back, as collecting does."""
    async with HttpStoreClient(server.url) as store:
        [attempt] = await store.query_attempts(rollout.rollout_id)
        await store.complete_attempt(attempt.attempt_id, 1.0)
        rollouts = await store.query_rollouts(rollout_ids=[rollout.rollout_id])
        spans = await store.query_spans([rollout.rollout_id], "latest")
    return rollouts, spans


async def _versions(server) -> list:
    async with HttpStoreClient(server.url) as store:
        return await store.list_policy_versions()


def test_the_adapter_hash_is_of_the_content_wherever_the_folder_lies(adapters, tmp_path):
    first = provenance.adapter_hash(adapters[0])
    moved = shutil.copytree(adapters[0], tmp_path / "elsewhere")
    assert provenance.adapter_hash(moved) == first
    assert provenance.adapter_hash(adapters[1]) != first
    weights = moved / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert provenance.adapter_hash(moved) != first


def test_the_template_fingerprint_changes_with_the_template_only(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    again = AutoTokenizer.from_pretrained(model_dir)
    assert provenance.template_fingerprint(tokenizer) == provenance.template_fingerprint(again)
    # A template that drops earlier turns' reasoning renders other prompts: another fingerprint.
    again.chat_template = (tokenizer.chat_template or "") + "{# strips <think> #}"
    assert provenance.template_fingerprint(again) != provenance.template_fingerprint(tokenizer)


def test_the_probe_difference_by_hand():
    a = ProbeAnswer(tokens=["x", "y"], logprobs=[-1.0, -2.0])
    assert checks.probe_difference(a, a) == 0.0
    shifted = ProbeAnswer(tokens=["x", "y"], logprobs=[-1.0, -2.25])
    assert checks.probe_difference(shifted, a) == 0.25
    other = ProbeAnswer(tokens=["x", "z"], logprobs=[-1.0, -2.0])
    assert checks.probe_difference(other, a) == float("inf")


def test_each_call_span_names_the_adapter_bytes_and_template_that_answered(
    server, adapters, model_dir
):
    name = publish_policy.fn(server.url, "s-v1", server.model, str(adapters[0]), 1)
    with httpx.Client(base_url=server.url) as http:
        details = http.get("/health/details").json()
        declared = http.get(f"/store/policy-versions/{name}").json()["metadata"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert details["template_fingerprint"] == provenance.template_fingerprint(tokenizer)
    assert declared[semconv.ADAPTER_HASH_METADATA] == provenance.adapter_hash(adapters[0])

    base_url, rollout = _attempt(server)
    _chat(base_url, name)
    _chat(base_url, server.model)
    _, spans = asyncio.run(_finish(server, rollout))
    calls = [s.attributes for s in spans if semconv.PROMPT_TOKEN_IDS in s.attributes]
    assert [c[semconv.POLICY_VERSION] for c in calls] == [name, server.model]
    assert calls[0][semconv.ADAPTER_HASH] == provenance.adapter_hash(adapters[0])
    assert semconv.ADAPTER_HASH not in calls[1]  # the base model has no adapter
    assert {c[semconv.TEMPLATE_FINGERPRINT] for c in calls} == {details["template_fingerprint"]}


def test_a_folder_rewritten_after_its_hash_was_declared_is_not_served(server, adapters):
    version = {
        "name": "s-rewritten",
        "base_model": server.model,
        "adapter_path": str(adapters[1]),
        # What the publisher hashed: another adapter's bytes than the folder holds now.
        "metadata": {semconv.ADAPTER_HASH_METADATA: provenance.adapter_hash(adapters[0])},
    }
    with httpx.Client(base_url=server.url) as http:
        reply = http.post("/store/policy-versions", json=version)
        assert reply.status_code == 400, reply.text
        assert "rewritten after it was published" in reply.json()["error"]["message"]
        assert http.get("/store/policy-versions/s-rewritten").status_code == 404
    assert "s-rewritten" not in server.gateway.backend.adapters()


def test_a_publish_whose_load_is_skipped_is_caught_by_the_probe(server, adapters, monkeypatch):
    config = ProvenanceConfig()
    publish_policy.fn(server.url, "p-v1", server.model, str(adapters[0]), 1)
    # A working publish: the new weights answer otherwise than the base model.
    metrics = probe_served_policy.fn(server.url, "p-v1", server.model, config)
    assert metrics["provenance/probes"] == 1.0

    backend = server.gateway.backend
    load = backend.load_adapter

    async def stale_load(name: str, path: str) -> None:
        # The silent failure: the new name is registered, the old weights stay.
        await load(name, str(adapters[0]))

    monkeypatch.setattr(backend, "load_adapter", stale_load)
    publish_policy.fn(server.url, "p-v2", server.model, str(adapters[1]), 2)
    with pytest.raises(PolicyNotServed, match="'p-v2' answers the probe exactly as 'p-v1'"):
        probe_served_policy.fn(server.url, "p-v2", "p-v1", config)

    monkeypatch.setattr(backend, "load_adapter", load)
    publish_policy.fn(server.url, "p-v3", server.model, str(adapters[2]), 3)
    assert probe_served_policy.fn(server.url, "p-v3", "p-v1", config)["provenance/probes"] == 1.0


def test_an_unchanged_adapter_is_not_probed(server, adapters):
    # A publish of the same bytes (an iteration without a learning signal): no change to see.
    publish_policy.fn(server.url, "u-v1", server.model, str(adapters[2]), 1)
    publish_policy.fn(server.url, "u-v2", server.model, str(adapters[2]), 2)
    assert probe_served_policy.fn(server.url, "u-v2", "u-v1", ProvenanceConfig()) == {
        "provenance/probes": 0.0
    }


def test_rollouts_that_disagree_with_the_runs_record_are_refused_and_counted(
    server, adapters, tmp_path
):
    name = publish_policy.fn(server.url, "r-v1", server.model, str(adapters[1]), 1)
    versions = asyncio.run(_versions(server))
    fingerprint = server.gateway.known_template_fingerprint
    record = ProvenanceRecord.of(server.model, versions, fingerprint)

    gathered: tuple[list[Rollout], list] = ([], [])
    for model in (name, server.model):
        base_url, rollout = _attempt(server)
        _chat(base_url, model)
        rollouts, spans = asyncio.run(_finish(server, rollout))
        gathered[0].extend(rollouts)
        gathered[1].extend(spans)

    kept = collect(*gathered, provenance=record)
    assert len(kept.transitions) == 2 and not kept.refused

    # The run's record says r-v1 was another adapter's bytes: its rollout is refused whole.
    other = record.model_copy(update={"versions": {name: provenance.adapter_hash(adapters[0])}})
    refused = collect(*gathered, provenance=other)
    assert dict(refused.refused) == {checks.ADAPTER_MISMATCH: 1}
    assert [t.policy_version for t in refused.transitions] == [server.model]
    # A version the run never published; a template the run did not start with.
    unknown = collect(*gathered, provenance=record.model_copy(update={"versions": {}}))
    assert dict(unknown.refused) == {checks.UNKNOWN_VERSION: 1}
    retemplated = collect(
        *gathered, provenance=record.model_copy(update={"template_fingerprint": "0" * 64})
    )
    assert dict(retemplated.refused) == {checks.TEMPLATE_MISMATCH: 2}
    assert not retemplated.transitions

    # The analytics export holds why, and the iteration's metric counts the refused rollouts.
    analytics.export_iteration(
        tmp_path, 1, analytics.transition_rows(refused.transitions, refused.facts)
    )
    con = analytics.connect(tmp_path, ":memory:")
    assert analytics.iteration_metrics(con, 1)["rollout/provenance_refused"] == 1.0
    reasons = con.execute(
        "SELECT provenance_refused FROM episodes ORDER BY 1 NULLS LAST"
    ).fetchall()
    assert reasons == [(checks.ADAPTER_MISMATCH,), (None,)]


def test_a_transition_without_the_provenance_the_record_expects_is_refused():
    # The gateway writes the version, hash and fingerprint on every call it answers: a call
    # without one the record expects was not written by the run's gateway (issue 43; more in
    # tests/test_hostile_spans.py).
    record = ProvenanceRecord(
        base_model="base", versions={"v1": "a" * 64}, template_fingerprint="f"
    )
    t = Transition(
        rollout_id="r", step=0, prompt_token_ids=[1], response_token_ids=[2], policy_version="v1"
    )
    assert record.disagreement(t) == checks.MISSING_PROVENANCE
    whole = t.model_copy(update={"adapter_hash": "a" * 64, "template_fingerprint": "f"})
    assert record.disagreement(whole) is None
    assert (
        record.disagreement(whole.model_copy(update={"adapter_hash": "b" * 64}))
        == checks.ADAPTER_MISMATCH
    )
    # Nothing is expected of what the record does not know: the base model has no adapter.
    unrecorded = record.model_copy(update={"template_fingerprint": None})
    assert unrecorded.disagreement(t.model_copy(update={"policy_version": "base"})) is None
