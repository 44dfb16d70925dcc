"""Soak: the store and the gateway under 64 concurrent clients for 3 minutes, on loopback.

One `lightning-rl serve` child (the tiny random Llama as its policy, a DuckDB file as its store)
and N client coroutines in this process, each with its own OpenAI client and store client,
each playing rollouts in a loop until the time is up:

    enqueue -> dequeue (any queued rollout) -> heartbeat -> 1..3 chat completions under the
    attempt's URL (one in three streamed) -> add 2 spans -> complete with a reward ->
    query the rollout and its latest attempt's spans -> a plain /v1 call now and then

and checks what it reads back: the rollout succeeded with its reward, and the attempt holds
every span sent and one LLM span per gateway call (a missing one counts as an error). Each
client has one request in flight at a time, so the load is bounded by the client count.

Printed: requests and errors by kind, p50/p99 latency, the server's resident memory (its
process tree: the server and its DuckDB worker) every 20 s from the end of the warm-up, and the
lines `soak_requests: N`, `soak_errors: N`, `soak_rss_growth_pct: X` (end against the end of
the warm-up). Exits 1 on any error.

Why a minute of warm-up: under 64 clients the server's RSS climbs by ~140 MiB over the first
~50 s (the backend's batch buffers and the allocator's pools reaching the high-water mark of
the peak batch) and then holds (measured: 705-722 MiB from 50 s to 130 s). A store-only load
grows ~0.1 MiB/s at 330 requests/s: the in-memory index of rollouts (~3 KB each) and DuckDB's
cache of the growing file, which is the store's design, not a leak.

    python benchmarks/soak.py                          # 64 clients, 180 s (60 s of warm-up)
    python benchmarks/soak.py --seconds 5 --clients 8 --warmup 1   # the smoke test's run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
import psutil  # noqa: E402

from benchmarks.results import record_printed  # noqa: E402
from lightning_core import semconv  # noqa: E402
from lightning_core.models import tiny_model_dir  # noqa: E402
from lightning_core.serving.process import free_port, start_serve, stop_serve  # noqa: E402
from lightning_core.store.client import HttpStoreClient  # noqa: E402
from lightning_core.types import RolloutRequest, RolloutStatus, Span  # noqa: E402

MAX_TOKENS = 8  # short answers: the soak is about the servers, not the model's speed
SAMPLE_S = 20.0  # how often the server's memory is read


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss(pid: int) -> tuple[int, int]:
    """Resident bytes of a process and of its children (the store's DuckDB worker)."""
    proc = psutil.Process(pid)
    children = 0
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            children += child.memory_info().rss
    return proc.memory_info().rss, children


class Tally:
    """Latencies and errors by kind of request."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.first_errors: list[str] = []

    async def timed(self, kind: str, call: Any) -> Any:
        start = time.perf_counter()
        try:
            result = await call
        except Exception as exc:
            self.error(kind, f"{type(exc).__name__}: {exc}")
            exc.soak_counted = True  # type: ignore[attr-defined]
            raise
        self.latencies[kind].append(time.perf_counter() - start)
        return result

    def error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if len(self.first_errors) < 10:
            self.first_errors.append(f"{kind}: {message[:300]}")

    @property
    def requests(self) -> int:
        return sum(len(v) for v in self.latencies.values()) + self.error_count

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


class Client:
    """One soak client: its own store client and OpenAI client, one request at a time."""

    def __init__(self, index: int, url: str, model: str, tally: Tally) -> None:
        self.index = index
        self.url = url
        self.model = model
        self.tally = tally
        self.rng = random.Random(index)
        self.store = HttpStoreClient(url)
        self.llm = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def close(self) -> None:
        await self.store.close()
        await self.llm.close()

    async def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                await self.episode()
            except Exception as exc:  # the client goes on with a new rollout
                if not getattr(exc, "soak_counted", False):
                    self.tally.error("episode", f"{type(exc).__name__}: {exc}")

    async def chat(self, llm: openai.AsyncOpenAI, kind: str, stream: bool) -> None:
        messages = [{"role": "user", "content": f"Count to {self.rng.randint(2, 9)}."}]
        if not stream:
            answer = await self.tally.timed(
                kind,
                llm.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=MAX_TOKENS
                ),
            )
            if answer.choices[0].message.role != "assistant":
                self.tally.error(kind, f"odd answer {answer}")
            return

        async def streamed() -> int:
            chunks = 0
            response = await llm.chat.completions.create(
                model=self.model, messages=messages, max_tokens=MAX_TOKENS, stream=True
            )
            async for _ in response:
                chunks += 1
            return chunks

        if await self.tally.timed(kind + "_stream", streamed()) < 2:
            self.tally.error(kind + "_stream", "a stream without content")

    async def episode(self) -> None:
        timed, store = self.tally.timed, self.store
        task = {"question": f"q{self.rng.randrange(10**6)}", "padding": "x" * 200}
        await timed("enqueue", store.enqueue_rollout(RolloutRequest(input=task)))
        claim = await timed("dequeue", store.dequeue(f"soak:{self.index}"))
        if claim is None:  # another client took every queued rollout: fine, go again
            return
        rollout_id, attempt_id = claim.rollout.rollout_id, claim.attempt.attempt_id
        await timed("heartbeat", store.heartbeat(attempt_id))
        in_rollout = self.llm.with_options(
            base_url=f"{self.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1"
        )
        calls = self.rng.randint(1, 3)
        for _ in range(calls):
            await self.chat(in_rollout, "chat_rollout", stream=self.rng.random() < 1 / 3)
        now = time.time()
        spans = [
            Span(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                trace_id=f"{self.rng.getrandbits(128):032x}",
                span_id=f"{self.rng.getrandbits(64):016x}",
                name=f"tool-{k}",
                start_time=now,
                end_time=now + 0.001,
                attributes={"tool.output": "y" * 500, "k": k},
            )
            for k in range(2)
        ]
        await timed("add_spans", store.add_spans(spans))
        reward = self.rng.random()
        await timed("complete", store.complete_attempt(attempt_id, reward))
        [rollout] = await timed("query_rollouts", store.query_rollouts(rollout_ids=[rollout_id]))
        if rollout.status != RolloutStatus.succeeded:
            self.tally.error("query_rollouts", f"{rollout_id} is {rollout.status}, not succeeded")
        stored = await timed("query_spans", store.query_spans([rollout_id], "latest"))
        llm_spans = [s for s in stored if semconv.PROMPT_TOKEN_IDS in s.attributes]
        if len(llm_spans) != calls or len(stored) < calls + len(spans):
            self.tally.error(
                "query_spans",
                f"{rollout_id}: {len(llm_spans)} LLM spans for {calls} calls, {len(stored)} in all",
            )
        if self.rng.random() < 0.25:
            await self.chat(self.llm, "chat_plain", stream=False)


@dataclass
class SoakResult:
    tally: Tally
    clients: int
    warmup: float
    elapsed: float
    # (seconds into the soak, server RSS, its children's RSS), every SAMPLE_S; the first
    # after the warm-up, the last at the end.
    samples: list[tuple[float, int, int]]

    @property
    def rss_start(self) -> int:
        return sum(self.samples[0][1:])

    @property
    def rss_end(self) -> int:
        return sum(self.samples[-1][1:])


async def soak(url: str, clients: int, seconds: float, warmup: float, pid: int) -> SoakResult:
    """Run the clients against the server at `url` (process `pid`) for `seconds`."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as llm:
        model = (await llm.models.list()).data[0].id  # the served base model
    tally = Tally()
    players = [Client(i, url, model, tally) for i in range(clients)]
    start = time.monotonic()
    deadline = start + seconds
    runs = asyncio.gather(*(p.run(deadline) for p in players))
    await asyncio.sleep(min(warmup, seconds))
    samples = []
    while not runs.done():
        samples.append((time.monotonic() - start, *rss(pid)))
        await asyncio.wait([runs], timeout=SAMPLE_S)
    await runs
    samples.append((time.monotonic() - start, *rss(pid)))
    for p in players:
        await p.close()
    return SoakResult(tally, clients, warmup, time.monotonic() - start, samples)


def report(result: SoakResult) -> str:
    tally, elapsed = result.tally, result.elapsed
    lines = [
        f"soak: {result.clients} clients, {elapsed:.0f} s, tiny random Llama, max_tokens "
        f"{MAX_TOKENS}",
        "",
        f"| {'request':<20} | {'count':>7} | {'errors':>6} | {'p50 ms':>7} | {'p99 ms':>7} |",
        f"|{'-' * 22}|{'-' * 9}|{'-' * 8}|{'-' * 9}|{'-' * 9}|",
    ]
    kinds = sorted(set(tally.latencies) | set(tally.errors))
    for kind in kinds:
        ms = [x * 1000 for x in tally.latencies.get(kind, [])]
        errors = tally.errors.get(kind, 0)
        lines.append(
            f"| {kind:<20} | {len(ms) + errors:>7} | {errors:>6} | {_pct(ms, 0.5):>7.1f} | "
            f"{_pct(ms, 0.99):>7.1f} |"
        )
    errors = tally.error_count
    growth = 100 * (result.rss_end - result.rss_start) / result.rss_start
    lines += [
        f"| {'all':<20} | {tally.requests:>7} | {errors:>6} | {'':>7} | {'':>7} |",
        "",
        f"requests/s: {tally.requests / elapsed:.0f}",
        f"server RSS (server + DuckDB worker): {result.rss_start / 2**20:.0f} MiB after "
        f"{result.warmup:.0f} s of warm-up, {result.rss_end / 2**20:.0f} MiB at the end",
        "RSS over time (s: server + worker MiB): "
        + ", ".join(f"{t:.0f}: {a / 2**20:.0f} + {b / 2**20:.0f}" for t, a, b in result.samples),
        f"soak_requests: {tally.requests}",
        f"soak_errors: {errors}",
        f"soak_rss_growth_pct: {growth:.1f}",
    ]
    lines += [f"error: {e}" for e in tally.first_errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="Concurrent clients.")
    parser.add_argument("--seconds", type=float, default=180.0, help="Length of the soak.")
    parser.add_argument(
        "--warmup", type=float, default=60.0, help="Seconds into the soak of the first RSS."
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lightning-soak-") as tmp:
        port = free_port()
        server = start_serve(Path(tmp) / "soak.duckdb", port, "--model", str(tiny_model_dir()))
        try:
            url = f"http://127.0.0.1:{port}"
            result = asyncio.run(soak(url, args.clients, args.seconds, args.warmup, server.pid))
        finally:
            stop_serve(server)
    text = report(result)
    print(text)
    # A soak of other settings (the smoke test's seconds) is a figure of its own.
    settings = (args.clients, args.seconds, args.warmup)
    variant = (
        None
        if settings == (64, 180.0, 60.0)
        else "clients {}, {} s, warm-up {} s".format(*settings)
    )
    record_printed(text, "soak_", variant=variant)
    return 1 if result.tally.error_count else 0


if __name__ == "__main__":
    sys.exit(main())
