"""The gateway's limits, hit with the official OpenAI and Anthropic clients on a real server.

Each limit is set low on a real gateway (tiny random model) and passed through every API it
speaks, streamed or not: the client must raise its own error type (BadRequestError for a
request too big, RateLimitError for an attempt over its calls), with the setting to change in
the message, and a spent budget must not be retried by the client.
"""

from __future__ import annotations

import gc

import anthropic
import httpx
import openai
import pytest

from lightning_core.errors import RateLimited
from lightning_core.gateway.limits import CallLimits, CallSlot
from lightning_core.gateway.service import held
from lightning_core.store.server import MAX_QUERY_IDS, MAX_WAIT_S
from tests.conftest import gateway_server

LIMITS = {
    "max_prompt_tokens": 64,
    "max_generation_tokens": 2000,
    "max_concurrent_calls_per_rollout": 2,
    "max_calls_per_rollout": 4,
}
LONG = "word " * 200  # ~200 tokens: over max_prompt_tokens
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with gateway_server(model="tiny", gateway_options=LIMITS) as running:
        yield running


def new_attempt(server) -> tuple[str, str, str]:
    """A claimed rollout attempt: (its gateway URL without /v1, rollout id, attempt id)."""
    with httpx.Client(base_url=server.url) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        claim = http.post("/store/dequeue", json={"worker_id": "limits"}).json()
    rollout_id, attempt_id = rollout["rollout_id"], claim["attempt"]["attempt_id"]
    return f"{server.url}/rollouts/{rollout_id}/attempts/{attempt_id}", rollout_id, attempt_id


def openai_client(base: str, requests: list | None = None, **kw) -> openai.AsyncOpenAI:
    async def count(request: httpx.Request) -> None:
        requests.append(request.url.path)

    hooks = {"request": [count]} if requests is not None else {}
    http = httpx.AsyncClient(event_hooks=hooks)
    kw.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", http_client=http, **kw)


def anthropic_client(base: str, **kw) -> anthropic.AsyncAnthropic:
    kw.setdefault("max_retries", 0)
    return anthropic.AsyncAnthropic(base_url=base, api_key="unused", **kw)


async def test_a_prompt_over_the_limit_is_a_400_in_every_api_streamed_or_not(server):
    base, *_ = new_attempt(server)
    for url in (base, server.url):  # in a rollout and outside any
        oa, an = openai_client(url), anthropic_client(url)
        long_chat = [{"role": "user", "content": LONG}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="MAX_PROMPT_TOKENS") as caught:
                await oa.chat.completions.create(
                    model=server.model, messages=long_chat, max_tokens=4, stream=stream
                )
            assert caught.value.body["type"] == "invalid_request_error"
            with pytest.raises(openai.BadRequestError, match="MAX_PROMPT_TOKENS"):
                await oa.completions.create(
                    model=server.model, prompt=LONG, max_tokens=4, stream=stream
                )
            with pytest.raises(openai.BadRequestError, match="MAX_PROMPT_TOKENS"):
                await oa.responses.create(
                    model=server.model, input=LONG, max_output_tokens=4, stream=stream
                )
            with pytest.raises(anthropic.BadRequestError, match="MAX_PROMPT_TOKENS") as caught:
                await an.messages.create(
                    model=server.model, messages=long_chat, max_tokens=4, stream=stream
                )
            assert caught.value.body["error"]["type"] == "invalid_request_error"
        # Megabytes are refused before the tokenizer sees them (it would take seconds).
        huge = "word " * 200_000
        with pytest.raises(openai.BadRequestError, match=r"characters \(counted at \d+ a token\)"):
            await oa.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": huge}], max_tokens=1
            )
        with pytest.raises(openai.BadRequestError, match=r"characters \(counted at \d+ a token\)"):
            await oa.completions.create(model=server.model, prompt=huge, max_tokens=1)
        # A batch of short prompts counts together.
        with pytest.raises(openai.BadRequestError, match="MAX_PROMPT_TOKENS"):
            await oa.completions.create(model=server.model, prompt=["word " * 20] * 5, max_tokens=1)


async def test_n_times_max_tokens_over_the_limit_is_a_400(server):
    base, *_ = new_attempt(server)
    oa, an = openai_client(base), anthropic_client(base)
    with pytest.raises(openai.BadRequestError, match=r"n=4 x max tokens 600 = 2400"):
        await oa.chat.completions.create(model=server.model, messages=HI, n=4, max_tokens=600)
    with pytest.raises(openai.BadRequestError, match="MAX_GENERATION_TOKENS"):
        await oa.chat.completions.create(
            model=server.model, messages=HI, n=2, max_tokens=1200, stream=True
        )
    with pytest.raises(openai.BadRequestError, match=r"3 prompts x n=1 x max tokens 700"):
        await oa.completions.create(model=server.model, prompt=["a", "b", "c"], max_tokens=700)
    with pytest.raises(openai.BadRequestError, match="MAX_GENERATION_TOKENS"):
        await oa.responses.create(model=server.model, input="hi", max_output_tokens=2001)
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError, match="MAX_GENERATION_TOKENS"):
            await an.messages.create(
                model=server.model, messages=HI, max_tokens=2001, stream=stream
            )
    # Refused calls spend none of the attempt's budget: four calls at the limit still pass.
    answer = await oa.chat.completions.create(model=server.model, messages=HI, n=2, max_tokens=8)
    assert len(answer.choices) == 2
    for _ in range(3):
        await oa.completions.create(model=server.model, prompt="hi", max_tokens=2)


async def test_an_attempt_past_its_calls_gets_a_429_that_no_client_retries(server):
    base, _, attempt_id = new_attempt(server)
    sent: list[str] = []
    oa = openai_client(base, sent, max_retries=3)
    # The budget is the attempt's, whichever API spends it.
    await oa.chat.completions.create(model=server.model, messages=HI, max_tokens=2)
    await oa.completions.create(model=server.model, prompt="hi", max_tokens=2)
    await oa.responses.create(model=server.model, input="hi", max_output_tokens=2)
    message = await anthropic_client(base).messages.create(
        model=server.model, messages=HI, max_tokens=2
    )
    assert message.usage.output_tokens >= 1
    sent.clear()
    with pytest.raises(openai.RateLimitError, match="MAX_CALLS_PER_ROLLOUT") as caught:
        await oa.chat.completions.create(model=server.model, messages=HI, max_tokens=2)
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert caught.value.body["type"] == "rate_limit_error" and attempt_id in str(caught.value)
    assert len(sent) == 1  # max_retries=3, yet asked once: retrying cannot help
    with pytest.raises(openai.RateLimitError):
        await oa.completions.create(model=server.model, prompt="hi", max_tokens=2, stream=True)
    with pytest.raises(anthropic.RateLimitError, match="MAX_CALLS_PER_ROLLOUT") as caught:
        await anthropic_client(base, max_retries=3).messages.create(
            model=server.model, messages=HI, max_tokens=2, stream=True
        )
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    # Another attempt, and calls outside any rollout, have budgets of their own.
    other, *_ = new_attempt(server)
    await openai_client(other).chat.completions.create(
        model=server.model, messages=HI, max_tokens=2
    )
    for _ in range(5):
        await openai_client(server.url).completions.create(
            model=server.model, prompt="hi", max_tokens=1
        )


async def test_too_many_calls_at_once_in_one_attempt_get_a_429_and_the_client_retries(server):
    base, *_ = new_attempt(server)
    oa = openai_client(base)
    # Two long streams hold the attempt's two slots: admitted before their headers came back,
    # running until 2000 tokens are generated (seconds; the random model hardly ever ends
    # sooner) or the client closes them.
    streams = [
        await oa.completions.create(model=server.model, prompt="hi", max_tokens=2000, stream=True)
        for _ in range(2)
    ]
    with pytest.raises(openai.RateLimitError, match="2 calls running") as caught:
        await oa.chat.completions.create(model=server.model, messages=HI, max_tokens=2)
    assert caught.value.response.headers["x-should-retry"] == "true"
    with pytest.raises(anthropic.RateLimitError, match="MAX_CONCURRENT_CALLS_PER_ROLLOUT"):
        await anthropic_client(base).messages.create(model=server.model, messages=HI, max_tokens=2)
    # Closing a stream frees its slot; the client's own retries (on 429) then get through.
    await streams[0].close()
    retrying = openai_client(base, max_retries=4)
    answer = await retrying.chat.completions.create(model=server.model, messages=HI, max_tokens=2)
    assert answer.choices[0].message.role == "assistant"
    await streams[1].close()


def test_attempt_counters_stay_bounded_and_keep_running_calls():
    limits = CallLimits(10**6, 10**6, max_concurrent_calls=2, max_calls=3, tracked=4)
    busy = limits.admit("ro-busy", "at-1")
    for i in range(100):
        limits.admit(f"ro-{i}", "at-1").release()
    assert limits.tracked_attempts() == 4
    # The attempt with a call running was kept: its slot still counts.
    limits.admit("ro-busy", "at-1")
    with pytest.raises(RateLimited, match="2 calls running"):
        limits.admit("ro-busy", "at-1")
    busy.release()
    with pytest.raises(RateLimited, match="made its 3 LLM calls"):
        for _ in range(2):
            limits.admit("ro-busy", "at-1")
    assert limits.admit(None, None) is not None  # outside a rollout: nothing counted
    assert limits.tracked_attempts() == 4


async def test_a_stream_dropped_unread_releases_its_slot():
    limits = CallLimits(10**6, 10**6, max_concurrent_calls=1, max_calls=10)

    async def events():
        yield 1

    slot: CallSlot = limits.admit("ro", "at")
    stream = held(slot, events())
    with pytest.raises(RateLimited, match="1 calls running"):
        limits.admit("ro", "at")
    del stream
    gc.collect()
    limits.admit("ro", "at").release()
    # Read to the end, it releases too: the next call is admitted.
    stream = held(limits.admit("ro", "at"), events())
    assert [e async for e in stream] == [1]
    limits.admit("ro", "at")


def test_store_queries_and_waits_are_bounded(server):
    too_many = [f"ro-{i}" for i in range(MAX_QUERY_IDS + 1)]
    with httpx.Client(base_url=server.url) as http:
        for path, body in (
            ("/store/spans/query", {"rollout_ids": too_many}),
            ("/store/wait", {"rollout_ids": too_many, "timeout": 1}),
            ("/store/rollouts/query", {"rollout_ids": too_many}),
            ("/store/transitions/query", {"rollout_ids": too_many}),
        ):
            answer = http.post(path, json=body)
            assert answer.status_code == 422, path
            assert "rollout_ids" in answer.json()["error"]["message"]
            assert f"at most {MAX_QUERY_IDS} items" in answer.json()["error"]["message"]
        answer = http.post("/store/dequeue", json={"worker_id": "w", "wait": MAX_WAIT_S + 1})
        assert answer.status_code == 422 and "wait" in answer.json()["error"]["message"]
        # At the cap, a query is answered (none of these rollouts exist: an empty list).
        answer = http.post("/store/rollouts/query", json={"rollout_ids": too_many[:-1]})
        assert answer.status_code == 200 and answer.json() == []
