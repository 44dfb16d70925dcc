"""Policy replicas: `lightning-rl serve --replicas N` serves one policy from N backend processes.

Routing unit tests run ReplicatedBackend over simple in-process fake backends (least-loaded,
affinity slack, adapters all-or-none, replicas going down). The rest start the real thing:
`serve --replicas 2` with the tiny model, two replica processes, the official `openai` client
over loopback, policy versions published through the store client as training publishes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from lightning_core.backends.base import (
    Choice,
    GenerationRequest,
    StreamDelta,
    check_stream_request,
)
from lightning_core.backends.replicas import ReplicatedBackend
from lightning_core.errors import BackendUnavailable, Conflict, InvalidInput
from lightning_core.serving import process as serving
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import PolicyVersion

# ---------------------------------------------------------------- unit: routing over fakes


class FakeBackend:
    """A backend that answers one token, can hold its calls open, and can be 'down'."""

    def __init__(self) -> None:
        self.base_model = "fake"
        self.tokenizer = None
        self.loaded: set[str] = set()
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self.down = False
        self.fail_load = False
        self.die_mid_stream = False
        self.closed = False

    def adapters(self) -> list[str]:
        return sorted(self.loaded)

    async def generate(self, request: GenerationRequest) -> list[Choice]:
        self.calls += 1
        if self.down:
            raise BackendUnavailable("connection refused")
        if self.gate is not None:
            await self.gate.wait()
        return [Choice(token_ids=[1], logprobs=[0.0], finish_reason="stop")]

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        check_stream_request(request)
        return self._stream()

    async def _stream(self) -> AsyncIterator[StreamDelta]:
        self.calls += 1
        if self.down:
            raise BackendUnavailable("connection refused")
        yield StreamDelta(token_ids=[1], logprobs=[0.0])
        if self.die_mid_stream:
            raise BackendUnavailable("connection reset")
        yield StreamDelta(finish_reason="stop")

    async def load_adapter(self, name: str, path: str) -> None:
        if self.fail_load:
            raise InvalidInput(f"{path} is not a PEFT adapter folder")
        self.loaded.add(name)

    async def unload_adapter(self, name: str) -> None:
        self.loaded.discard(name)

    async def close(self) -> None:
        self.closed = True


def request(affinity: str | None = None, adapter: str | None = None) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=[1, 2], affinity=affinity, adapter=adapter)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_routing_unit_least_loaded_spreads_calls_over_fakes():
    a, b = FakeBackend(), FakeBackend()
    a.gate = b.gate = asyncio.Event()
    replicated = ReplicatedBackend([a, b])
    calls = [asyncio.create_task(replicated.generate(request())) for _ in range(4)]
    await settle()
    assert [r.in_flight for r in replicated.replicas] == [2, 2]
    a.gate.set()
    await asyncio.gather(*calls)
    # One after another, they alternate (fewest calls routed breaks the tie).
    for _ in range(4):
        await replicated.generate(request())
    assert (a.calls, b.calls) == (4, 4)
    assert [r.in_flight for r in replicated.replicas] == [0, 0]


async def test_routing_unit_affinity_sticks_within_the_slack_and_moves_past_it_over_fakes():
    a, b = FakeBackend(), FakeBackend()
    a.gate = b.gate = asyncio.Event()
    replicated = ReplicatedBackend([a, b], affinity_slack=2)
    held = [asyncio.create_task(replicated.generate(request("r1"))) for _ in range(3)]
    await settle()
    # In flight 0, 1, 2 against 0 elsewhere: within the slack, all three stayed home.
    assert (a.calls, b.calls) == (3, 0)
    assert replicated.affinity_hits == 2 and replicated.affinity_moves == 0
    # Home is 3 busier than the least-loaded: the key moves, and its next call follows it.
    held.append(asyncio.create_task(replicated.generate(request("r1"))))
    await settle()
    held.append(asyncio.create_task(replicated.generate(request("r1"))))
    await settle()
    assert (a.calls, b.calls) == (3, 2)
    assert replicated.affinity_moves == 1
    a.gate.set()
    await asyncio.gather(*held)
    stats = replicated.stats()
    assert stats["affinity_keys"] == 1 and stats["affinity_hits"] == 3


async def test_routing_unit_affinity_keys_are_kept_for_the_most_recent_only_over_fakes():
    replicated = ReplicatedBackend([FakeBackend(), FakeBackend()], max_affinity_keys=2)
    for key in ("a", "b", "a", "c"):
        await replicated.generate(request(key))
    assert list(replicated._homes) == ["a", "c"]


async def test_routing_unit_an_adapter_loads_on_every_replica_or_on_none_over_fakes():
    a, b = FakeBackend(), FakeBackend()
    replicated = ReplicatedBackend([a, b])
    await replicated.load_adapter("v1", "/adapters/v1")
    assert a.loaded == b.loaded == {"v1"} and replicated.adapters() == ["v1"]
    b.fail_load = True
    with pytest.raises(InvalidInput, match="not a PEFT adapter"):
        await replicated.load_adapter("v2", "/adapters/v2")
    assert a.loaded == b.loaded == {"v1"}
    await replicated.unload_adapter("v1")
    assert replicated.adapters() == []


async def test_routing_unit_a_down_replica_is_skipped_and_calls_go_to_the_others_over_fakes():
    a, b = FakeBackend(), FakeBackend()
    replicated = ReplicatedBackend([a, b], recheck_s=60)
    a.down = True
    for _ in range(4):
        assert len(await replicated.generate(request())) == 1
    # Tried once (the call was sent again to b), then left alone until its recheck.
    assert (a.calls, b.calls) == (1, 4)
    first = replicated.stats()["replicas"][0]
    assert first["up"] is False and first["errors"] == 1 and "refused" in first["last_error"]
    # A load skips it; calls for that adapter never go there.
    await replicated.load_adapter("v1", "/adapters/v1")
    assert a.loaded == set() and replicated.adapters() == ["v1"]
    b.down = True
    with pytest.raises(BackendUnavailable, match="no policy replica can serve this call"):
        await replicated.generate(request(adapter="v1"))
    await replicated.close()
    assert a.closed and b.closed


async def test_routing_unit_a_stream_moves_only_before_its_first_delta_over_fakes():
    a, b = FakeBackend(), FakeBackend()
    replicated = ReplicatedBackend([a, b])
    a.down = True
    deltas = [d async for d in replicated.stream(request())]
    assert deltas[-1].finish_reason == "stop" and (a.calls, b.calls) == (1, 1)
    b.die_mid_stream = True
    with pytest.raises(BackendUnavailable, match="reset"):
        [d async for d in replicated.stream(request())]
    assert b.calls == 2  # not sent again: a token had gone out
    with pytest.raises(InvalidInput, match="n must be 1"):
        replicated.stream(request().model_copy(update={"n": 2}))


def test_vllm_replicas_attach_to_one_server_each():
    from lightning_core.backends import create_backend
    from lightning_core.backends.vllm_backend import VLLMBackend

    backend = create_backend(
        "vllm", "tiny", vllm_url="http://127.0.0.1:8001/v1, http://127.0.0.1:8002"
    )
    assert isinstance(backend, ReplicatedBackend)
    urls = [r.backend.url for r in backend.replicas]
    assert urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert all(isinstance(r.backend, VLLMBackend) for r in backend.replicas)
    launched = create_backend("vllm", "tiny", replicas=3, options={"port": 9000})
    assert [r.backend.config.port for r in launched.replicas] == [9000, 9001, 9002]
    with pytest.raises(InvalidInput, match="comma-separated"):
        create_backend("vllm", "tiny", vllm_url="http://127.0.0.1:8001", replicas=2)
    with pytest.raises(InvalidInput, match="one URL per replica"):
        create_backend("vllm", "tiny", vllm_url="http://a:1,http://b:2", replicas=3)


# ---------------------------------------------------------------- real replica processes


def start_replicated(tmp: Path) -> tuple[object, str]:
    port = serving.free_port()
    # The tests' adapters lie in sibling folders of the store's (adapter_folder.py).
    env = {**os.environ, "LIGHTNING_ADAPTER_ROOTS": json.dumps([str(tmp.parent)])}
    proc = serving.start_serve(
        tmp / "s.duckdb", port, "--model", "tiny", "--replicas", "2", timeout=300, env=env
    )
    return proc, f"http://127.0.0.1:{port}"


def details(url: str) -> dict:
    return httpx.get(f"{url}/health/details", timeout=10).json()


def replica_stats(url: str) -> list[dict]:
    return details(url)["backend_stats"]["replicas"]


def calls_per_replica(url: str) -> list[int]:
    return [r["calls"] for r in replica_stats(url)]


def rollout_urls(url: str, count: int) -> list[str]:
    """Base URLs of `count` claimed rollout attempts."""
    with httpx.Client(base_url=url) as http:
        http.post("/store/rollouts", json={"rollouts": [{"input": i} for i in range(count)]})
        claims = [http.post("/store/dequeue", json={"worker_id": "w"}).json() for _ in range(count)]
    return [
        f"{url}/rollouts/{c['rollout']['rollout_id']}/attempts/{c['attempt']['attempt_id']}/v1"
        for c in claims
    ]


async def chat(base_url: str, model: str, text: str = "hi", stream: bool = False) -> str:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as api:
        messages = [{"role": "user", "content": text}]
        if not stream:
            answer = await api.chat.completions.create(model=model, messages=messages, max_tokens=4)
            return answer.choices[0].message.content or ""
        chunks = await api.chat.completions.create(
            model=model, messages=messages, max_tokens=4, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


def save_adapter(folder: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_core.models import tiny_model_dir

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    lora = LoraConfig(r=4, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    get_peft_model(base, lora).save_pretrained(folder)
    return folder


async def publish(url: str, name: str, base_model: str, adapter: Path) -> PolicyVersion:
    async with HttpStoreClient(url) as store:
        return await store.add_policy_version(
            PolicyVersion(name=name, base_model=base_model, adapter_path=str(adapter))
        )


@pytest.fixture(scope="module")
def replicated(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """`serve --replicas 2` with the tiny model: (its URL, the base model's name)."""
    proc, url = start_replicated(tmp_path_factory.mktemp("replicas"))
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield url, model
    finally:
        assert serving.stop_serve(proc) == 0


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return save_adapter(tmp_path_factory.mktemp("adapter") / "v1")


def test_calls_spread_over_both_replicas_and_a_rollouts_calls_stay_on_one(replicated):
    url, model = replicated
    info = details(url)
    assert info["backend"] == "ReplicatedBackend" and info["base_model"] == model
    before = calls_per_replica(url)
    hits, moves = info["backend_stats"]["affinity_hits"], info["backend_stats"]["affinity_moves"]

    async def rollout(base_url: str, calls: int) -> None:
        for i in range(calls):  # an agent's turns, one after another
            await chat(base_url, model, f"turn {i}", stream=i == 1)

    async def rollouts() -> None:
        await asyncio.gather(*(rollout(u, 3) for u in rollout_urls(url, 6)))

    asyncio.run(rollouts())
    after = calls_per_replica(url)
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == 18 and min(served) > 0, served
    stats = details(url)["backend_stats"]
    # Loads stayed even (at most 3 rollouts' calls on either): no rollout's call moved.
    assert stats["affinity_moves"] == moves
    assert stats["affinity_hits"] - hits == 6 * 2
    # Each replica counts what it served itself, the same calls.
    own = [httpx.get(f"{r['url']}/health").json() for r in replica_stats(url)]
    assert [o["calls"] for o in own] == after
    assert len({o["pid"] for o in own}) == 2 and all(o["in_flight"] == 0 for o in own)

    # A rollout alone: every one of its calls on one replica.
    before = calls_per_replica(url)
    [alone] = rollout_urls(url, 1)
    asyncio.run(rollout(alone, 4))
    served = sorted(a - b for a, b in zip(calls_per_replica(url), before, strict=True))
    assert served == [0, 4]


def test_a_version_is_loaded_on_every_replica_before_it_is_published(replicated, adapter):
    url, model = replicated
    replicas = [r["url"] for r in replica_stats(url)]
    asyncio.run(publish(url, "policy-r1", model, adapter))
    # Published means loaded everywhere: each replica says so itself, at once.
    for replica in replicas:
        assert "policy-r1" in httpx.get(f"{replica}/adapters").json()
    before = calls_per_replica(url)

    async def calls() -> list[str]:
        return await asyncio.gather(*(chat(f"{url}/v1", "policy-r1") for _ in range(8)))

    assert len(asyncio.run(calls())) == 8
    served = [a - b for a, b in zip(calls_per_replica(url), before, strict=True)]
    assert sum(served) == 8 and min(served) > 0, served

    # A version whose adapter no replica can load is refused, and listed nowhere.
    with pytest.raises(InvalidInput, match="not a PEFT adapter folder"):
        asyncio.run(publish(url, "policy-bad", model, adapter.parent / "missing"))
    names = [v["name"] for v in httpx.get(f"{url}/store/policy-versions").json()]
    assert "policy-r1" in names and "policy-bad" not in names
    for replica in replicas:
        assert httpx.get(f"{replica}/adapters").json() == ["policy-r1"]
    # A name taken already is refused by the store, and its adapter stays where it was.
    with pytest.raises(Conflict):
        asyncio.run(publish(url, "policy-r1", model, adapter))
    for replica in replicas:
        assert httpx.get(f"{replica}/adapters").json() == ["policy-r1"]
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [model, "policy-r1"]


def test_a_replica_key_is_needed_to_generate_or_load(replicated):
    url, _ = replicated
    replica = replica_stats(url)[0]["url"]
    answer = httpx.post(f"{replica}/generate", json={"prompt_token_ids": [1]})
    assert answer.status_code == 401 and answer.json()["error"]["type"] == "Unauthorized"
    answer = httpx.put(f"{replica}/adapters/x", json={"path": "/tmp"})
    assert answer.status_code == 401


def _gone(pid: int, timeout: float = 30) -> bool:
    """Whether process `pid` ends within `timeout` (a zombie, not yet reaped, has ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_a_killed_replica_leaves_the_other_serving(tmp_path, adapter):
    proc, url = start_replicated(tmp_path)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        pids = [httpx.get(f"{r['url']}/health").json()["pid"] for r in replica_stats(url)]
        os.kill(pids[0], signal.SIGKILL)
        assert _gone(pids[0])

        async def calls() -> list[str]:
            plain = [chat(f"{url}/v1", model) for _ in range(6)]
            return await asyncio.gather(*plain, chat(f"{url}/v1", model, stream=True))

        assert len(asyncio.run(calls())) == 7
        dead, alive = replica_stats(url)
        assert dead["up"] is False and dead["errors"] >= 1 and alive["up"] is True
        assert alive["calls"] >= 7
        # A version published meanwhile is loaded on the replica that is up, and served.
        asyncio.run(publish(url, "policy-k1", model, adapter))
        assert asyncio.run(chat(f"{url}/v1", "policy-k1")) is not None
    finally:
        assert serving.stop_serve(proc) == 0
    # Stopping the server stopped its replicas.
    assert _gone(pids[1])
