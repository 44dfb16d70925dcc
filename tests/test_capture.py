"""Production capture: calls on the gateway's plain /v1 routes that name an episode are recorded
on that episode, with the same exact token ids and logprobs as a rollout's calls.

Real servers on loopback (store + gateway + the tiny model), the official `openai` and
`anthropic` clients, the episode named by the `X-Lightning-Episode` header or by
`metadata.episode_id`, streamed and not. One server per capture setting: "episodes" (the
default), "all" (with a low max_calls_per_rollout, which episodes are exempt from) and "off".
"""

from __future__ import annotations

import asyncio
import uuid

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from lightning_core import semconv
from lightning_core.data.adapter import spans_to_transitions
from lightning_core.feedback import episode_headers
from lightning_core.gateway.chat import encode, render_chat
from lightning_core.models import tiny_model_dir
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import RolloutMode, RolloutStatus, Span
from tests.conftest import gateway_server

HI = [{"role": "user", "content": "Say something."}]


def _serve(**gateway_options):
    return gateway_server(model="tiny", gateway_options=gateway_options)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_dir())


@pytest.fixture(scope="module")
def server():
    with _serve() as running:  # capture "episodes", the default
        yield running


@pytest.fixture(scope="module")
def capture_all():
    with _serve(capture="all", max_calls_per_rollout=2) as running:
        yield running


@pytest.fixture(scope="module")
def capture_off():
    with _serve(capture="off") as running:
        yield running


def new_episode() -> str:
    return f"session:{uuid.uuid4().hex[:12]}"


def openai_client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, **kw)


def anthropic_client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, **kw)


def calls_of(server, episode_id: str) -> list[Span]:
    """The LLM-call spans recorded on the episode, in arrival order."""
    with httpx.Client(base_url=server.url) as http:
        r = http.post("/store/spans/query", json={"rollout_ids": [f"ep-{episode_id}"]})
    assert r.status_code == 200, r.text
    spans = [Span.model_validate(s) for s in r.json()]
    return [s for s in spans if semconv.PROMPT_TOKEN_IDS in s.attributes]


def production_rollouts(server) -> dict[str, dict]:
    with httpx.Client(base_url=server.url) as http:
        rows = http.post("/store/rollouts/query", json={"mode": "production"}).json()
    return {r["rollout_id"]: r for r in rows}


def attempts_of(server, rollout_id: str) -> list[dict]:
    with httpx.Client(base_url=server.url) as http:
        return http.get(f"/store/rollouts/{rollout_id}/attempts").json()


def response_ids(span: Span, i: int = 0) -> list[int]:
    return span.attributes[semconv.RESPONSE.format(i=i, key="token_ids")]


def response_logprobs(span: Span, i: int = 0) -> list[float]:
    return span.attributes[semconv.RESPONSE.format(i=i, key="logprobs")]


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt the gateway must have fed the model, tokenized here independently."""
    return encode(tokenizer, render_chat(tokenizer, messages, None, "line"))


# ---------------------------------------------------------------------------- every API


def _openai_chat(server, headers, metadata, stream):
    raw = openai_client(server).chat.completions.with_raw_response.create(
        model=server.model,
        messages=HI,
        max_tokens=10,
        stream=stream,
        extra_headers=headers,
        metadata=metadata,
    )
    answer = raw.parse()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    else:
        text = answer.choices[0].message.content
    return raw.headers, text


def _openai_completions(server, headers, metadata, stream):
    raw = openai_client(server).completions.with_raw_response.create(
        model=server.model, prompt="Once upon a time", max_tokens=10, stream=stream,
        extra_headers=headers, extra_body={"metadata": metadata} if metadata else None,
    )  # fmt: skip
    answer = raw.parse()
    text = "".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text
    return raw.headers, text


def _openai_responses(server, headers, metadata, stream):
    raw = openai_client(server).responses.with_raw_response.create(
        model=server.model, input="Say something.", max_output_tokens=10, stream=stream,
        extra_headers=headers, metadata=metadata,
    )  # fmt: skip
    answer = raw.parse()
    if stream:
        text = "".join(e.delta for e in answer if e.type == "response.output_text.delta")
    else:
        text = answer.output_text
    return raw.headers, text


def _anthropic_messages(server, headers, metadata, stream):
    raw = anthropic_client(server).messages.with_raw_response.create(
        model=server.model, max_tokens=10, messages=HI, stream=stream,
        extra_headers=headers, extra_body={"metadata": metadata} if metadata else None,
    )  # fmt: skip
    answer = raw.parse()
    if stream:
        text = "".join(
            e.delta.text
            for e in answer
            if e.type == "content_block_delta" and e.delta.type == "text_delta"
        )
    else:
        text = "".join(b.text for b in answer.content if b.type == "text")
    return raw.headers, text


APIS = {
    "chat.completions": _openai_chat,
    "completions": _openai_completions,
    "responses": _openai_responses,
    "messages": _anthropic_messages,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("named_by", ["header", "metadata"])
@pytest.mark.parametrize("api", list(APIS))
def test_a_call_naming_an_episode_is_recorded_on_it(server, tokenizer, api, named_by, stream):
    episode_id = new_episode()
    if named_by == "header":
        headers, metadata = {**episode_headers(episode_id), "X-Lightning-Agent": "support"}, None
    else:
        headers = {"X-Lightning-Agent": "support"}
        metadata = {"episode_id": episode_id}
    answered_headers, text = APIS[api](server, headers, metadata, stream)
    assert answered_headers["x-lightning-episode"] == episode_id

    [span] = calls_of(server, episode_id)
    assert tokenizer.decode(response_ids(span), skip_special_tokens=True) == text
    assert len(response_logprobs(span)) == len(response_ids(span)) > 0
    attrs = span.attributes
    assert attrs[semconv.API] == api
    assert attrs[semconv.AGENT_NAME] == "support"
    assert attrs[semconv.POLICY_VERSION] == server.model
    rollout = production_rollouts(server)[f"ep-{episode_id}"]
    assert rollout["status"] == "running" and rollout["input"] == {"episode_id": episode_id}
    assert rollout["policy_version"] == server.model
    [attempt] = attempts_of(server, f"ep-{episode_id}")
    assert span.attempt_id == attempt["attempt_id"] == attrs[semconv.ATTEMPT_ID]
    assert attempt["worker_id"] == "production" and attempt["status"] == "running"


def test_exact_token_ids_and_logprobs_streamed_or_not(server, tokenizer):
    episode_id = new_episode()
    api = openai_client(server, default_headers=episode_headers(episode_id))
    whole = api.chat.completions.create(
        model=server.model, messages=HI, max_tokens=12, logprobs=True, seed=3
    )
    chunks = list(
        api.chat.completions.create(
            model=server.model, messages=HI, max_tokens=12, logprobs=True, seed=4, stream=True
        )
    )
    first, second = calls_of(server, episode_id)
    expected_prompt = chat_prompt_ids(tokenizer, HI)
    assert first.attributes[semconv.PROMPT_TOKEN_IDS] == expected_prompt
    assert second.attributes[semconv.PROMPT_TOKEN_IDS] == expected_prompt
    served = whole.choices[0].logprobs.content
    assert [tokenizer.decode([t]) for t in response_ids(first)] == [t.token for t in served]
    assert response_logprobs(first) == [t.logprob for t in served]
    assert len(served) == whole.usage.completion_tokens
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in
                c.choices[0].logprobs.content]  # fmt: skip
    assert [tokenizer.decode([t]) for t in response_ids(second)] == [t.token for t in streamed]
    assert response_logprobs(second) == [t.logprob for t in streamed]
    assert first.attempt_id == second.attempt_id  # one episode, one attempt


async def test_transitions_from_an_episode_are_the_served_tokens(server, tokenizer):
    episode_id = new_episode()
    api = openai_client(server)
    conversation = list(HI)
    served = []
    for turn in range(3):
        answer = api.chat.completions.create(
            model=server.model,
            messages=conversation,
            max_tokens=8,
            logprobs=True,
            extra_headers={**episode_headers(episode_id), "X-Lightning-Agent": "support"},
        )
        choice = answer.choices[0]
        served.append((list(conversation), choice))
        conversation += [
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": f"And then? ({turn})"},
        ]
    async with HttpStoreClient(server.url) as client:
        [rollout] = await client.query_rollouts([f"ep-{episode_id}"])
        spans = await client.query_spans([rollout.rollout_id], "latest")
    assert rollout.mode is RolloutMode.production and rollout.status is RolloutStatus.running
    transitions = spans_to_transitions(spans, rollout)
    assert [t.step for t in transitions] == [0, 1, 2]
    for transition, (messages, choice) in zip(transitions, served, strict=True):
        assert transition.rollout_id == f"ep-{episode_id}"
        assert transition.prompt_token_ids == chat_prompt_ids(tokenizer, messages)
        tokens = choice.logprobs.content
        assert [tokenizer.decode([t]) for t in transition.response_token_ids] == [
            t.token for t in tokens
        ]
        assert transition.response_logprobs == [t.logprob for t in tokens]
        text = tokenizer.decode(transition.response_token_ids, skip_special_tokens=True)
        assert text == choice.message.content
        assert transition.agent_name == "support"
        assert transition.policy_version == server.model
        assert transition.reward == 0.0  # the reward comes later, as feedback


async def test_concurrent_first_calls_open_one_episode(server):
    episode_id = new_episode()
    api = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        max_retries=0,
        default_headers=episode_headers(episode_id),
    )
    await asyncio.gather(
        *(
            api.chat.completions.create(model=server.model, messages=HI, max_tokens=4)
            for _ in range(4)
        )
    )
    await api.close()
    assert len(attempts_of(server, f"ep-{episode_id}")) == 1
    assert len(calls_of(server, episode_id)) == 4


# ---------------------------------------------------------------------------- what is not kept


def test_calls_without_an_episode_id_are_not_kept(server):
    before = production_rollouts(server)
    raw = openai_client(server).chat.completions.with_raw_response.create(
        model=server.model, messages=HI, max_tokens=4
    )
    assert raw.parse().choices[0].message.content is not None
    assert "x-lightning-episode" not in raw.headers
    streamed = anthropic_client(server).messages.with_raw_response.create(
        model=server.model, max_tokens=4, messages=HI, stream=True
    )
    assert list(streamed.parse()) and "x-lightning-episode" not in streamed.headers
    assert production_rollouts(server) == before


def test_an_invalid_episode_id_is_a_400_in_the_apis_shape(server):
    before = production_rollouts(server)
    oa, an = openai_client(server), anthropic_client(server)
    for stream in (False, True):
        for bad in ("has space", "-dash-first", "x" * 129, "a/b"):
            with pytest.raises(openai.BadRequestError, match="episode id") as caught:
                oa.chat.completions.create(
                    model=server.model, messages=HI, max_tokens=4, stream=stream,
                    extra_headers={"X-Lightning-Episode": bad},
                )  # fmt: skip
            assert caught.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match="episode id"):
            oa.responses.create(
                model=server.model, input="hi", max_output_tokens=4, stream=stream,
                metadata={"episode_id": "semi;colon"},
            )  # fmt: skip
        with pytest.raises(anthropic.BadRequestError, match="episode id") as refused:
            an.messages.create(
                model=server.model, max_tokens=4, messages=HI, stream=stream,
                extra_headers={"X-Lightning-Episode": "has space"},
            )  # fmt: skip
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "invalid_request_error"
    with httpx.Client(base_url=server.url) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": server.model, "messages": HI, "metadata": {"episode_id": 42}},
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "InvalidInput"
    assert production_rollouts(server) == before


def test_a_rollout_prefixed_call_ignores_episode_ids(server):
    with httpx.Client(base_url=server.url) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        claim = {"rollout": {}}
        while claim["rollout"].get("rollout_id") != rollout["rollout_id"]:
            claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    rollout_id, attempt_id = rollout["rollout_id"], claim["attempt"]["attempt_id"]
    base = f"{server.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1"
    api = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    before = production_rollouts(server)
    episode_id = new_episode()
    for headers in (episode_headers(episode_id), {"X-Lightning-Episode": "not valid"}):
        raw = api.chat.completions.with_raw_response.create(
            model=server.model, messages=HI, max_tokens=4, extra_headers=headers,
            metadata={"episode_id": episode_id},
        )  # fmt: skip
        assert raw.parse().choices and "x-lightning-episode" not in raw.headers
    assert production_rollouts(server) == before
    with httpx.Client(base_url=server.url) as http:
        spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
    assert [s["attempt_id"] for s in spans] == [attempt_id, attempt_id]


# ---------------------------------------------------------------------------- capture all / off


def test_capture_all_keeps_each_call_without_an_id_as_its_own_episode(capture_all, tokenizer):
    api = openai_client(capture_all)
    given = []
    for stream in (False, True):
        raw = api.chat.completions.with_raw_response.create(
            model=capture_all.model, messages=HI, max_tokens=6, stream=stream
        )
        answer = raw.parse()
        text = (
            "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
            if stream
            else answer.choices[0].message.content
        )
        episode_id = raw.headers["x-lightning-episode"]
        [span] = calls_of(capture_all, episode_id)
        assert tokenizer.decode(response_ids(span), skip_special_tokens=True) == text
        given.append(episode_id)
    assert given[0] != given[1]
    # A named call still goes to its own episode.
    named = new_episode()
    raw = api.chat.completions.with_raw_response.create(
        model=capture_all.model, messages=HI, max_tokens=4, extra_headers=episode_headers(named)
    )
    assert raw.headers["x-lightning-episode"] == named
    assert len(calls_of(capture_all, named)) == 1


def test_an_episode_is_not_stopped_by_max_calls_per_rollout(capture_all):
    """max_calls_per_rollout is 2 on this server: a rollout attempt's third call is refused,
    a production episode's fifth goes through (gateway/limits.py says why)."""
    api = openai_client(capture_all, default_headers=episode_headers(episode := new_episode()))
    for _ in range(5):
        api.chat.completions.create(model=capture_all.model, messages=HI, max_tokens=2)
    assert len(calls_of(capture_all, episode)) == 5
    with httpx.Client(base_url=capture_all.url) as http:
        [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
        claim = {"rollout": {}}
        while claim["rollout"].get("rollout_id") != rollout["rollout_id"]:
            claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
    prefix = f"/rollouts/{rollout['rollout_id']}/attempts/{claim['attempt']['attempt_id']}/v1"
    in_rollout = openai.OpenAI(base_url=capture_all.url + prefix, api_key="unused", max_retries=0)
    for _ in range(2):
        in_rollout.chat.completions.create(model=capture_all.model, messages=HI, max_tokens=2)
    with pytest.raises(openai.RateLimitError, match="max_calls_per_rollout"):
        in_rollout.chat.completions.create(model=capture_all.model, messages=HI, max_tokens=2)


def test_capture_off_keeps_nothing(capture_off):
    api = openai_client(capture_off)
    raw = api.chat.completions.with_raw_response.create(
        model=capture_off.model,
        messages=HI,
        max_tokens=4,
        extra_headers=episode_headers(episode_id := new_episode()),
    )
    assert raw.parse().choices and "x-lightning-episode" not in raw.headers
    assert production_rollouts(capture_off) == {}
    # A malformed id is still the client's error, whatever the server keeps.
    with pytest.raises(openai.BadRequestError, match="episode id"):
        api.chat.completions.create(
            model=capture_off.model, messages=HI, max_tokens=4,
            extra_headers={"X-Lightning-Episode": "not valid"},
        )  # fmt: skip
    with httpx.Client(base_url=capture_off.url) as http:
        assert http.get(f"/episodes/{episode_id}").status_code == 404


def test_feedback_on_an_episode_the_gateway_opened(server):
    episode_id = new_episode()
    openai_client(server).chat.completions.create(
        model=server.model, messages=HI, max_tokens=2, extra_headers=episode_headers(episode_id)
    )
    with httpx.Client(base_url=server.url) as http:
        r = http.post(f"/episodes/{episode_id}/feedback", json={"value": 1.0, "source": "user"})
        assert r.status_code == 201, r.text
        episode = http.get(f"/episodes/{episode_id}").json()
    assert episode["rollout"]["rollout_id"] == f"ep-{episode_id}"
    assert [(f["source"], f["value"]) for f in episode["feedback"]] == [("user", 1.0)]


# ---------------------------------------------------------------------------- model aliases


def test_an_alias_serves_its_target_and_spans_name_the_version_that_answered():
    # `lightning-rl production` serves the champion as "champion" this way.
    with gateway_server(
        model="tiny",
        served_model_name="tiny-v7",
        gateway_options={"model_aliases": {"champion": "tiny-v7"}},
    ) as aliased:
        episode = new_episode()
        reply = openai_client(aliased).chat.completions.create(
            model="champion", messages=HI, max_tokens=4, extra_headers=episode_headers(episode)
        )
        assert reply.choices[0].message.content is not None
        (span,) = calls_of(aliased, episode)
        assert span.attributes[semconv.POLICY_VERSION] == "tiny-v7"
        with pytest.raises(openai.NotFoundError):
            openai_client(aliased).chat.completions.create(
                model="challenger", messages=HI, max_tokens=4
            )
