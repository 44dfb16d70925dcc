"""One request never hurts another, and the event loop never stalls (issue 25, items 1-2).

Against a real `lightning-rl serve --model tiny` on loopback with the official OpenAI client,
and on the transformers backend itself where a fault must be injected into the model.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time

import httpx
import openai
import pytest

from lightning_core.backends.base import Constraint, GenerationRequest, SamplingParams
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.errors import InvalidInput
from lightning_core.serving import process as serving

# A Lark rule of 2,100 alternatives: llguidance compiles it, then gives up on its first token
# ("Current row has 2101 items; max is 2000").
WIDE_GRAMMAR = "start: " + " | ".join(f'"a{i}"' for i in range(2100))
HI = [{"role": "user", "content": "Hello there"}]


def enum_schema(values: int) -> dict:
    return {
        "type": "object",
        "properties": {"v": {"enum": [f"v{i}" for i in range(values)]}},
        "required": ["v"],
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`lightning-rl serve --model tiny` in its own process, as users run it."""
    port = serving.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    proc = serving.start_serve(
        tmp_path_factory.mktemp("serve") / "s.duckdb", port, "--model", "tiny", env=env
    )
    try:
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield url, model
    finally:
        serving.stop_serve(proc)


def client(url: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **kw)


async def test_a_2100_alternative_grammar_beside_5_generating_requests_is_its_own_400(server):
    """Finding: a grammar of 2,100 alternatives failed inside the engine's step, and
    `_fail_all` answered all 5 unrelated requests generating beside it with a 500."""
    url, model = server
    oa = client(url)

    async def generate(started: asyncio.Event) -> tuple[str | None, int]:
        stream = await oa.chat.completions.create(
            model=model, messages=HI, max_tokens=100, temperature=1.0, stream=True
        )
        finish, chunks = None, 0
        async for chunk in stream:
            started.set()
            chunks += 1
            finish = chunk.choices[0].finish_reason or finish
        return finish, chunks

    starts = [asyncio.Event() for _ in range(5)]
    running = [asyncio.create_task(generate(s)) for s in starts]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
    with pytest.raises(openai.BadRequestError, match="MAX_ALTERNATIVES"):
        await oa.chat.completions.create(
            model=model,
            messages=HI,
            max_tokens=8,
            extra_body={"structured_outputs": {"grammar": WIDE_GRAMMAR}},
        )
    assert not any(task.done() for task in running), "the 5 must still be generating"
    results = await asyncio.gather(*running)
    assert [finish for finish, _ in results] == ["length"] * 5
    await oa.close()


async def test_a_grammar_failing_inside_the_engine_fails_its_own_request_only():
    """Finding: an error in one sequence (here llguidance's row limit, hit while decoding a
    grammar that passed validation) failed every request in the batch. On the backend itself,
    below the gateway's limits, so that the grammar reaches the engine."""
    backend = TransformersBackend(model="tiny")
    try:
        prompt = backend.tokenizer("Hello there")["input_ids"]
        free = [
            backend.generate(
                GenerationRequest(
                    prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=40, seed=i)
                )
            )
            for i in range(5)
        ]
        bad = GenerationRequest(
            prompt_token_ids=prompt,
            params=SamplingParams(
                max_new_tokens=8, constraint=Constraint(kind="grammar", grammar=WIDE_GRAMMAR)
            ),
        )
        tasks = [asyncio.create_task(f) for f in free]
        await decoding(backend, 5)  # the 5 are decoding when the bad one joins
        with pytest.raises(InvalidInput, match="grammar failed while generating"):
            await backend.generate(bad)
        results = await asyncio.gather(*tasks)
        assert [len(choices[0].token_ids) for choices in results] == [40] * 5
        assert backend.stats()["running"] == 0
    finally:
        await backend.close()


async def decoding(backend: TransformersBackend, rows: int) -> None:
    """Wait until `rows` sequences are decoding in the backend's batch."""
    deadline = time.monotonic() + 60
    while backend.stats()["running"] < rows:
        assert time.monotonic() < deadline, backend.stats()
        await asyncio.sleep(0.01)


def _poll_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            start = time.perf_counter()
            http.get(f"{url}/health").raise_for_status()
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)


@pytest.mark.parametrize(
    "prompt",
    # 2.6 MB; then just under the new pre-check (520 KB), the slowest text to tokenize found.
    ["word " * 520_000, " ".join(str(i) for i in range(88_000))],
    ids=["2.6MB", "520KB-numbers"],
)
async def test_health_stays_fast_while_a_huge_prompt_is_processed(server, prompt):
    """Finding: a 2.6 MB prompt (just under the old pre-check of 81 characters a token)
    was rendered and tokenized on the event loop, blocking every route, /health included, for
    2.4-3.5 s. Now it is refused by a realistic characters-per-token bound, and one just under
    that bound (520 KB, ~520k tokens) is tokenized on a worker thread."""
    url, model = server
    oa = client(url, timeout=120)
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_poll_health, args=(url, stop, latencies), daemon=True)
    poller.start()
    try:
        await asyncio.sleep(0.2)
        for _ in range(2):  # twice: the second finds the tokenizer and caches warm
            calls = [
                oa.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}]
                )
                for _ in range(3)  # at once: on the loop they would stall it one after another
            ]
            for refused in await asyncio.gather(*calls, return_exceptions=True):
                assert isinstance(refused, openai.BadRequestError), refused
                assert "MAX_PROMPT_TOKENS" in str(refused)
        await asyncio.sleep(0.2)
    finally:
        stop.set()
        poller.join(timeout=30)
        await oa.close()
    assert len(latencies) >= 10
    p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    # Generous for a loaded 2-core machine: the old code stalled 2.4-3.5 s.
    assert p99 < 0.5, f"/health p99 {p99:.3f} s, max {max(latencies):.3f} s"


@pytest.mark.parametrize(
    ("structured_outputs", "limit"),
    [
        ({"grammar": WIDE_GRAMMAR}, "MAX_ALTERNATIVES"),
        ({"grammar": "start: " + " | ".join(['"a"'] * 30_000)}, "MAX_ALTERNATIVES"),
        ({"grammar": 'start: "' + "x" * 300_000 + '"'}, "MAX_GRAMMAR_BYTES"),
        ({"json": enum_schema(30_000)}, "MAX_ENUM_VALUES"),
        ({"json": enum_schema(60_000)}, "MAX_GRAMMAR_BYTES"),  # 530 KB
        ({"json": {"anyOf": [{"const": i} for i in range(2_100)]}}, "MAX_ALTERNATIVES"),
    ],
    ids=["lark-2100", "lark-30k", "lark-300kb", "enum-30k", "enum-60k", "anyof-2100"],
)
async def test_grammars_over_a_limit_are_a_400_naming_it(server, structured_outputs, limit):
    """Finding: grammar size was not bounded before admission: 2,100 alternatives failed in
    the engine (a 500 for everyone generating) and 30k-60k alternatives gave a 500 outright."""
    url, model = server
    oa = client(url)
    with pytest.raises(openai.BadRequestError, match=limit):
        await oa.chat.completions.create(
            model=model,
            messages=HI,
            max_tokens=4,
            extra_body={"structured_outputs": structured_outputs},
        )
    with pytest.raises(openai.BadRequestError, match=limit):
        await oa.completions.create(
            model=model,
            prompt="Hello",
            max_tokens=4,
            extra_body={"structured_outputs": structured_outputs},
        )
    await oa.close()


async def test_normal_grammars_stay_within_the_limits(server):
    """The limits leave room for real use: a JSON enum of 3,000 values still works."""
    url, model = server
    oa = client(url)
    answer = await oa.chat.completions.create(
        model=model,
        messages=HI,
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": enum_schema(3_000)},
        },
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    await oa.close()


def test_grammar_limits_count_alternatives_outside_literals_and_nesting_without_recursion():
    """The walk behind the 400s: `|` inside a string literal is no alternative, one inside a
    regex is a lexer-level value; a schema nested 5,000 deep is refused, not a RecursionError."""
    from lightning_core.backends.grammar_limits import check_constraint

    quoted = "start: " + " | ".join('"a|b|c"' for _ in range(900))
    check_constraint(Constraint(kind="grammar", grammar=quoted))
    regex = "start: /" + "|".join(f"w{i}" for i in range(5000)) + "/"
    check_constraint(Constraint(kind="grammar", grammar=regex))
    wider = "start: /" + "|".join(f"w{i}" for i in range(12_000)) + "/"
    with pytest.raises(InvalidInput, match="MAX_ENUM_VALUES"):
        check_constraint(Constraint(kind="grammar", grammar=wider))
    deep: dict = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidInput, match="MAX_NESTING"):
        check_constraint(Constraint(kind="json_schema", json_schema=deep))


async def test_a_failed_prefill_fails_its_requests_only_and_a_failed_model_recovers():
    """Finding: any error in a step failed every request. A prefill of new prompts that
    raises (say, out of memory for a long one) now fails those requests alone; a decode forward
    that raises (the model itself) fails all running ones, and the next requests are served."""
    backend = TransformersBackend(model="tiny")
    engine = backend._engine
    batch = engine.batch
    prompt = backend.tokenizer("Hello there")["input_ids"]

    def request(tokens: int, seed: int = 0) -> GenerationRequest:
        return GenerationRequest(
            prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=tokens, seed=seed)
        )

    decodes = {"faults": 0}
    prefill, decode = batch.prefill, batch.decode

    def faulty_prefill(jobs):
        # The prompts of one request only (it asks for 4 tokens), as an out-of-memory would.
        if any(job.request.params.max_new_tokens == 4 for job in jobs):
            raise RuntimeError("injected prefill fault")
        return prefill(jobs)

    def faulty_decode():
        if decodes["faults"]:
            decodes["faults"] -= 1
            raise RuntimeError("injected decode fault")
        return decode()

    batch.prefill, batch.decode = faulty_prefill, faulty_decode
    try:
        running = [asyncio.create_task(backend.generate(request(80, i))) for i in range(3)]
        await decoding(backend, 3)
        with pytest.raises(RuntimeError, match="injected prefill fault"):
            await backend.generate(request(4))
        results = await asyncio.gather(*running)
        assert [len(r[0].token_ids) for r in results] == [80] * 3

        running = [asyncio.create_task(backend.generate(request(80, i))) for i in range(3)]
        await decoding(backend, 3)
        decodes["faults"] = 1
        failed = await asyncio.gather(*running, return_exceptions=True)
        assert all("injected decode fault" in str(e) for e in failed)
        again = await asyncio.gather(*(backend.generate(request(10, i)) for i in range(3)))
        assert [len(r[0].token_ids) for r in again] == [10] * 3
        assert engine.stats()["running"] == 0 and not engine.closed
    finally:
        await backend.close()
