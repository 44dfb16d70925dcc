"""Abuse: a well-behaved workload beside a hostile mix, against one `lightning-rl serve`.

One server on loopback (the tiny random Llama as its policy, a DuckDB file as its store). The
well-behaved workload is benchmarks/soak.py's client: 8 of them, each playing rollouts in a loop
(enqueue, claim, chat calls under the attempt, spans, complete, read back and check). A probe
reads /health every 20 ms from a process of its own, and the hostile mix runs in another
(attackers are other processes: their work must not be measured as the server's). The same
workload runs twice:

1. alone, for `--baseline` seconds: its p99 latency and /health's p99 without hostility;
2. beside the hostile mix, for `--seconds` (60 by default), each hostile kind in its own loop:
   - huge prompts: a 2.6 MB chat message (just under the old character pre-check);
   - huge OTLP bodies: 150,000 tiny spans in one protobuf export (6 MB);
   - huge grammars: Lark grammars (structured outputs) of 2,100 and 50,000 alternatives;
   - idle connections: up to 1,000 sockets that open and never send a byte, and slowloris
     clients that send a header line every few seconds;
   - disconnects mid-body: 20 MB declared, 10 MB sent, then closed;
   - long polls: /store/wait on 10,000 copies of one id, 30 s each, 16 at a time;
   - rewards out of range: a reward span of 1e200 on an attempt the attacker claimed;
   - span floods: 4,000-span requests on that attempt, past its quota
     (LIGHTNING_MAX_SPANS_PER_ATTEMPT);
   - feedback out of range: 1e200 on an episode, then GET /serving/routing (both answers);
   - feedback sources: bursts of new sources on one episode, past LIGHTNING_MAX_FEEDBACK_SOURCES
     (a burst's answer is its last one);
   - episode floods: new production episodes, with 60 KiB of metadata each and with none, past
     the server's bounds on labels and live episodes in memory (set low here, EPISODE_LIMITS,
     so that both are reached within the run; the well-behaved workload opens no episode).
3. a training run whose agents attack it with their own agent keys (benchmarks/abuse_training.py):
   it must finish (`training_run_stopped_by_agent`, goal 0) and train on no forged call.

What the hostile requests get back is counted but not judged (a 400 or 413 is the right answer
to most of them); what is judged is the good workload: every one of its requests must succeed
(`abuse_good_request_failures`, goal 0) and /health must stay fast (`abuse_health_p99_ms`, goal
at most 100). The server's memory after the attack is printed too (`abuse_server_rss_mb`).

    python benchmarks/abuse.py                     # 30 s alone, then 60 s beside the hostile mix
    python benchmarks/abuse.py --seconds 10 --baseline 5    # a quick look
    python benchmarks/abuse.py --no-training       # without the training run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import openai  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)

from benchmarks.abuse_training import hostile_training  # noqa: E402
from benchmarks.abuse_training import report as training_report  # noqa: E402
from benchmarks.results import record, record_printed  # noqa: E402
from benchmarks.soak import Client, Tally, _pct  # noqa: E402
from lightning_core import semconv  # noqa: E402
from lightning_core.models import tiny_model_dir  # noqa: E402
from lightning_core.serving.process import free_port, start_serve, stop_serve  # noqa: E402
from lightning_core.store.client import HttpStoreClient  # noqa: E402
from lightning_core.types import RolloutRequest  # noqa: E402

GOOD_CLIENTS = 8
HEALTH_EVERY_S = 0.02
HUGE_PROMPT_CHARS = 2_600_000
OTLP_SPANS = 150_000
GRAMMAR_ALTERNATIVES = (2_100, 50_000)
IDLE_SOCKETS = 1_000
CUT_DECLARED, CUT_SENT = 20 * 2**20, 10 * 2**20
LONG_POLLS, LONG_POLL_IDS = 16, 10_000
FLOOD_SPANS = 4_000
FEEDBACK_BURST = 20
EPISODE_METADATA_BYTES = 60 * 1024
# The abuse server's bounds on production episodes in memory: low, so that the flood reaches
# them in a minute (the defaults, 1,000,000 and 1 GiB, are a year of traffic).
EPISODE_LIMITS = {
    "LIGHTNING_MAX_LIVE_EPISODES": "300",
    "LIGHTNING_MAX_EPISODE_METADATA_BYTES": str(4 * 2**20),
}


@dataclass
class Hostile:
    """What the hostile requests got back: status code (or error name) by kind."""

    outcomes: dict[str, Counter] = field(default_factory=dict)

    def saw(self, kind: str, outcome: str) -> None:
        self.outcomes.setdefault(kind, Counter())[outcome] += 1


def _probe_health(url: str, deadline: float) -> tuple[list[float], list[str]]:
    """/health every HEALTH_EVERY_S until the deadline: latencies and failures. Run in a process
    of its own, so that what it measures is the server, not this process's busy event loop."""
    latencies: list[float] = []
    failures: list[str] = []
    with httpx.Client(timeout=10) as http:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                response = http.get(f"{url}/health")
                if response.status_code != 200:
                    failures.append(f"/health answered {response.status_code}")
            except httpx.HTTPError as exc:
                failures.append(f"/health: {type(exc).__name__}: {exc}")
            latencies.append(time.perf_counter() - start)
            time.sleep(HEALTH_EVERY_S)
    return latencies, failures


# Only these hostile kinds run, when set (--only): to find which one slows the server.
ONLY_ENV = "LIGHTNING_ABUSE_ONLY"


async def _loop(kind: str, deadline: float, hostile: Hostile, attack) -> None:
    """Run `attack` again and again until the deadline, counting what it got back."""
    only = os.environ.get(ONLY_ENV)
    if only and kind not in only.split(","):
        return
    while time.monotonic() < deadline:
        try:
            hostile.saw(kind, str(await attack()))
        except Exception as exc:  # a hostile request may be refused in any way
            hostile.saw(kind, type(exc).__name__)
        await asyncio.sleep(0.05)


def _otlp_body(spans: int) -> bytes:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in ((semconv.ROLLOUT_ID, "ro-abuse"), (semconv.ATTEMPT_ID, "at-abuse")):
        attribute = resource_spans.resource.attributes.add()
        attribute.key, attribute.value.string_value = key, value
    scope = resource_spans.scope_spans.add()
    for k in range(spans):
        span = scope.spans.add()
        span.trace_id = k.to_bytes(16, "big")
        span.span_id = (k + 1).to_bytes(8, "big")
        span.name = "s"
    return request.SerializeToString()


def _alternatives(count: int) -> str:
    """A Lark grammar of `count` alternatives (llguidance allows 2,000 in one row)."""
    return "start: " + " | ".join(f'"w{i}"' for i in range(count))


async def _raw(port: int, head: bytes, body: bytes, then_close: bool) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        for start in range(0, len(body), 2**20):
            writer.write(body[start : start + 2**20])
            await writer.drain()
        if then_close:
            return "closed mid-body"
        line = await asyncio.wait_for(reader.readline(), 30)
        return line.decode(errors="replace").split(" ")[1] if line else "closed"
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _idle_sockets(port: int, deadline: float, hostile: Hostile) -> None:
    """Sockets that connect and never send a byte, opened a few at a time up to the cap, kept
    open as long as the server keeps them; closed ones are counted and reopened."""
    sockets: list[socket.socket] = []
    try:
        while time.monotonic() < deadline:
            alive = []
            for s in sockets:
                try:
                    closed = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    hostile.saw("idle connection", "closed by the server")
                    s.close()
                else:
                    alive.append(s)
            sockets = alive
            for _ in range(min(50, IDLE_SOCKETS - len(sockets))):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                sockets.append(s)
                hostile.saw("idle connection", "opened")
            await asyncio.sleep(0.5)
    finally:
        for s in sockets:
            s.close()


async def _slowloris(port: int, deadline: float, hostile: Hostile) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        while time.monotonic() < deadline:
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
            await asyncio.sleep(3)
            if reader.at_eof():
                break
        hostile.saw("slowloris", "closed by the server" if reader.at_eof() else "held open")
    except OSError as exc:
        hostile.saw("slowloris", f"closed by the server ({type(exc).__name__})")
    finally:
        writer.close()


async def hostile_mix(url: str, port: int, model: str, deadline: float) -> Hostile:
    hostile = Hostile()
    llm = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    http = httpx.AsyncClient(base_url=url, timeout=120)
    otlp = await asyncio.to_thread(_otlp_body, OTLP_SPANS)
    cut_head = (
        f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/x-protobuf\r\nContent-Length: {CUT_DECLARED}\r\n\r\n"
    ).encode()

    async def huge_prompt() -> int:
        try:
            await llm.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "a " * (HUGE_PROMPT_CHARS // 2)}],
                max_tokens=4,
            )
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    async def huge_otlp() -> int:
        headers = {"content-type": "application/x-protobuf"}
        return (await http.post("/v1/traces", content=otlp, headers=headers)).status_code

    async def huge_grammar() -> str:
        answers = []
        for count in GRAMMAR_ALTERNATIVES:
            try:
                await llm.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Pick one."}],
                    max_tokens=4,
                    extra_body={"structured_outputs": {"grammar": _alternatives(count)}},
                )
                answers.append("200")
            except openai.APIStatusError as exc:
                answers.append(str(exc.status_code))
        return "/".join(answers)

    async def cut_body() -> str:
        return await _raw(port, cut_head, b"\0" * CUT_SENT, then_close=True)

    # An episode opened and never ended: a rollout that stays running, off the queue, so the
    # long polls wait their whole 30 s while the good clients' rollouts finish beside them.
    opened = await http.post("/episodes/abuse-long-poll", json={})
    waited_on = opened.json().get("rollout_id", "abuse-long-poll")

    async def long_poll() -> int:
        body = {"rollout_ids": [waited_on] * LONG_POLL_IDS, "timeout": 30}
        return (await http.post("/store/wait", json=body)).status_code

    # An attempt of the attacker's own (whatever rollout the queue gives it: the good clients
    # take any), for the span-level attacks.
    async with HttpStoreClient(url) as store:
        await store.enqueue_rollout(RolloutRequest(input={"question": "abuse"}))
        claim = await store.dequeue("abuse")
    own = (claim.rollout.rollout_id, claim.attempt.attempt_id) if claim else ("ro-x", "at-x")

    def spans(count: int, name: str, attributes: dict, first: int = 0) -> bytes:
        return orjson.dumps({
            "spans": [
                {
                    "rollout_id": own[0], "attempt_id": own[1], "name": name,
                    "trace_id": f"{first + k:032x}", "span_id": f"{first + k + 1:016x}",
                    "start_time": time.time(), "attributes": attributes,
                }
                for k in range(count)
            ]
        })  # fmt: skip

    json_headers = {"content-type": "application/json"}
    # Built once, like the OTLP body: what is measured is the server's work, not the attacker's.
    # Distinct ids, so that each is new spans (a repeat would be an exporter's retry, stored once).
    floods = [
        await asyncio.to_thread(spans, FLOOD_SPANS, "flood", {"x": "y" * 16}, k * FLOOD_SPANS)
        for k in range(4)
    ]
    flood_bodies = itertools.cycle(floods)
    huge_reward = spans(1, semconv.REWARD_SPAN, {semconv.REWARD_VALUE: 1e200}, 10**9)

    async def reward_out_of_range() -> int:
        sent = await http.post("/store/spans", content=huge_reward, headers=json_headers)
        return sent.status_code

    async def span_flood() -> int:
        body = next(flood_bodies)
        return (await http.post("/store/spans", content=body, headers=json_headers)).status_code

    feedback_episode = "abuse-feedback"
    await http.post(f"/episodes/{feedback_episode}", json={})
    sources = iter(range(10**9))

    async def feedback_out_of_range() -> str:
        body = {"value": 1e200, "source": "user"}
        sent = await http.post(f"/episodes/{feedback_episode}/feedback", json=body)
        routing = await http.get("/serving/routing")
        return f"{sent.status_code}/{routing.status_code}"

    async def feedback_sources() -> int:
        # A burst of new sources each time, so that even a short run passes the limit (16).
        for _ in range(FEEDBACK_BURST):
            body = {"value": 1.0, "source": f"source-{next(sources)}"}
            sent = await http.post(f"/episodes/{feedback_episode}/feedback", json=body)
            if sent.status_code >= 300:
                break
        return sent.status_code

    episodes = iter(range(10**9))
    labels = orjson.dumps({"metadata": {"notes": "x" * EPISODE_METADATA_BYTES}})

    async def labelled_episodes() -> int:
        path = f"/episodes/abuse-{next(episodes)}"
        return (await http.post(path, content=labels, headers=json_headers)).status_code

    async def episode_flood() -> int:
        return (await http.post(f"/episodes/abuse-{next(episodes)}", json={})).status_code

    try:
        await asyncio.gather(
            _loop("reward out of range", deadline, hostile, reward_out_of_range),
            _loop("span flood", deadline, hostile, span_flood),
            _loop(
                "feedback out of range (and /serving/routing)",
                deadline,
                hostile,
                feedback_out_of_range,
            ),
            _loop("feedback sources", deadline, hostile, feedback_sources),
            _loop("episode flood (60 KiB labels)", deadline, hostile, labelled_episodes),
            _loop("episode flood (no labels)", deadline, hostile, episode_flood),
            _loop("huge prompt", deadline, hostile, huge_prompt),
            _loop("huge OTLP body", deadline, hostile, huge_otlp),
            _loop("huge grammar", deadline, hostile, huge_grammar),
            _loop("disconnect mid-body", deadline, hostile, cut_body),
            *(_loop("long poll", deadline, hostile, long_poll) for _ in range(LONG_POLLS)),
            _idle_sockets(port, deadline, hostile),
            *(_slowloris(port, deadline, hostile) for _ in range(4)),
        )
    finally:
        await llm.close()
        await http.aclose()
    return hostile


@dataclass
class Phase:
    name: str
    seconds: float
    tally: Tally
    health: list[float]
    health_failures: list[str]
    hostile: Hostile | None = None

    @property
    def good_latencies_ms(self) -> list[float]:
        return [x * 1000 for values in self.tally.latencies.values() for x in values]


def _hostile_process(url: str, port: int, model: str, deadline: float) -> Hostile:
    """The hostile mix, in a process of its own as an attacker would be: building 6 MB bodies
    and juggling a thousand sockets must not slow the good clients' event loop."""
    return asyncio.run(hostile_mix(url, port, model, deadline))


async def phase(name: str, url: str, port: int, model: str, seconds: float, hostile: bool):
    tally = Tally()
    players = [Client(i, url, model, tally) for i in range(GOOD_CLIENTS)]
    # time.monotonic is the machine's clock (CLOCK_MONOTONIC): one deadline for every process.
    deadline = time.monotonic() + seconds
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        probe = loop.run_in_executor(pool, _probe_health, url, deadline)
        mix = (
            loop.run_in_executor(pool, _hostile_process, url, port, model, deadline)
            if hostile
            else None
        )
        await asyncio.gather(*(p.run(deadline) for p in players))
        health, health_failures = await probe
        attacks = await mix if mix is not None else None
    for p in players:
        await p.close()
    return Phase(name, seconds, tally, health, health_failures, attacks)


def report(phases: list[Phase]) -> str:
    lines = [
        f"abuse: {GOOD_CLIENTS} well-behaved clients (benchmarks/soak.py's rollouts), tiny random "
        f"Llama, {os.cpu_count()} cores",
        "",
        "| phase | seconds | good requests | good failures | good p50 ms | good p99 ms | "
        "/health probes | /health p99 ms | /health max ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        good = p.good_latencies_ms
        health = [x * 1000 for x in p.health]
        failures = p.tally.error_count + len(p.health_failures)
        lines.append(
            f"| {p.name} | {p.seconds:.0f} | {p.tally.requests} | {failures} | "
            f"{_pct(good, 0.5):.1f} | {_pct(good, 0.99):.1f} | {len(health)} | "
            f"{_pct(health, 0.99):.1f} | {max(health, default=float('nan')):.1f} |"
        )
    attacked = phases[-1]
    if attacked.hostile is not None:
        lines += ["", "| hostile kind | answers |", "|---|---|"]
        for kind, outcomes in attacked.hostile.outcomes.items():
            answers = ", ".join(f"{k} x{n}" for k, n in outcomes.most_common())
            lines.append(f"| {kind} | {answers} |")
    alone = phases[0]
    failures = attacked.tally.error_count + len(attacked.health_failures)
    lines += [
        "",
        f"abuse_good_request_failures: {failures}",
        f"abuse_health_p99_ms: {_pct([x * 1000 for x in attacked.health], 0.99):.1f}",
        f"abuse_good_p99_ms: {_pct(attacked.good_latencies_ms, 0.99):.1f}",
        f"abuse_good_p99_ms_without_hostile: {_pct(alone.good_latencies_ms, 0.99):.1f}",
        f"abuse_health_p99_ms_without_hostile: {_pct([x * 1000 for x in alone.health], 0.99):.1f}",
    ]
    for p in phases:
        lines += [f"error ({p.name}): {e}" for e in p.tally.first_errors]
        lines += [f"error ({p.name}): {e}" for e in p.health_failures[:10]]
    return "\n".join(lines)


async def run(url: str, port: int, seconds: float, baseline: float) -> list[Phase]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as llm:
        model = (await llm.models.list()).data[0].id
    alone = await phase("alone", url, port, model, baseline, hostile=False)
    attacked = await phase("beside the hostile mix", url, port, model, seconds, hostile=True)
    return [alone, attacked]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="Length of the attack.")
    parser.add_argument(
        "--baseline", type=float, default=30.0, help="Seconds of the workload alone first."
    )
    parser.add_argument(
        "--only",
        help="Comma-separated hostile kinds to run (as the table names them); all by "
        "default. The idle sockets and slowloris clients always run.",
    )
    parser.add_argument(
        "--no-training", action="store_true", help="Leave out the training run with attackers."
    )
    args = parser.parse_args(argv)
    if args.only:
        os.environ[ONLY_ENV] = args.only  # read by the hostile process, which inherits it
    with tempfile.TemporaryDirectory(prefix="lightning-abuse-") as tmp:
        port = free_port()
        env = os.environ | EPISODE_LIMITS
        db = Path(tmp) / "abuse.duckdb"
        server = start_serve(db, port, "--model", str(tiny_model_dir()), env=env)
        try:
            phases = asyncio.run(run(f"http://127.0.0.1:{port}", port, args.seconds, args.baseline))
            rss_mb = psutil.Process(server.pid).memory_info().rss / 2**20
        finally:
            stop_serve(server)
        # A shorter attack or some kinds only (`--only`) make figures of their own.
        default = (args.seconds, args.baseline, args.only) == (60.0, 30.0, None)
        shape = f"{args.seconds:g} s, baseline {args.baseline:g} s, kinds {args.only or 'all'}"
        variant = None if default else shape
        text = report(phases)
        print(text)
        record_printed(text, "abuse_", variant=variant)
        record("abuse_server_rss_mb", f"{rss_mb:.0f}", variant=variant)
        training = None if args.no_training else hostile_training(Path(tmp))
    if training is not None:
        lines = "\n".join(training_report(training))
        print("\n" + lines)
        record_printed(lines, "training_", variant=variant)
    attacked = phases[-1]
    failed = attacked.tally.error_count or attacked.health_failures
    return 1 if failed or (training is not None and training.stopped) else 0


if __name__ == "__main__":
    sys.exit(main())
