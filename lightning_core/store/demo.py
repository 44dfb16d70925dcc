"""`make demo` until the training flow lands: a store round trip through real processes.

Starts `lightning-rl serve` on a DuckDB file, enqueues arithmetic tasks, and runs runners that
claim them, trace a toy agent with the OpenTelemetry SDK (exported over OTLP/HTTP into the
store), emit rewards and complete their attempts. Then it kills the server with SIGKILL, restarts
it on the same file and shows that every acknowledged rollout and span is still there.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from lightning_core import semconv
from lightning_core.serving.process import free_port, start_serve, stop_serve
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import RolloutRequest, RolloutStatus, Task

TASKS = 48
RUNNERS = 4


def _serve(db: Path, port: int) -> subprocess.Popen:
    return start_serve(db, port, "--backend", "none")


async def _runner(name: str, store: HttpStoreClient, provider: TracerProvider) -> int:
    """Claim rollouts until the queue is empty; a toy agent answers a + b, wrong 30 % of tries."""
    tracer = provider.get_tracer("lightning-rl-demo")
    rng = random.Random(name)
    done = 0
    while (claim := await store.dequeue(name, wait=1.0)) is not None:
        ids = {
            semconv.ROLLOUT_ID: claim.rollout.rollout_id,
            semconv.ATTEMPT_ID: claim.attempt.attempt_id,
        }
        a, b = claim.rollout.input["a"], claim.rollout.input["b"]
        with (
            tracer.start_as_current_span("agent", attributes=ids),
            tracer.start_as_current_span("calculator", attributes=ids) as tool,
        ):
            answer = a + b + (rng.choice([-1, 1]) if rng.random() < 0.3 else 0)
            tool.set_attribute("tool.output", answer)
            await asyncio.sleep(rng.uniform(0, 0.02))
        reward = 1.0 if answer == a + b else 0.0
        tracer.start_span(
            semconv.REWARD_SPAN, attributes={**ids, semconv.REWARD_VALUE: reward}
        ).end()
        # The spans must be in the store before the attempt completes: its final reward is read
        # from the reward span.
        await asyncio.get_running_loop().run_in_executor(None, provider.force_flush)
        await store.complete_attempt(claim.attempt.attempt_id)
        done += 1
    return done


async def _summary(store: HttpStoreClient, ids: list[str]) -> tuple[int, int, float]:
    rollouts = await store.query_rollouts(rollout_ids=ids)
    spans = await store.query_spans(ids)
    succeeded = [r for r in rollouts if r.status is RolloutStatus.succeeded]
    mean = sum(r.episode_return or 0 for r in succeeded) / max(len(succeeded), 1)
    return len(succeeded), len(spans), mean


async def _run(db: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _serve(db, port)
    store = HttpStoreClient(url)
    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces"), schedule_delay_millis=50)
    )
    try:
        rng = random.Random(0)
        tasks = [
            Task(id=f"add-{i}", input={"a": rng.randint(1, 99), "b": rng.randint(1, 99)})
            for i in range(TASKS)
        ]
        rollouts = await store.enqueue_rollouts([RolloutRequest.for_task(t) for t in tasks])
        ids = [r.rollout_id for r in rollouts]
        print(f"enqueued {len(ids)} rollouts; {RUNNERS} runners pulling over HTTP", flush=True)
        t0 = time.perf_counter()
        counts = await asyncio.gather(
            *(_runner(f"runner-{i}", store, provider) for i in range(RUNNERS))
        )
        print(f"runners finished {sum(counts)} rollouts in {time.perf_counter() - t0:.1f} s")
        before = await _summary(store, ids)
        print(
            f"before the crash: {before[0]} succeeded, {before[1]} spans, mean reward "
            f"{before[2]:.2f}"
        )
    finally:
        provider.shutdown()
        await store.close()
        server.send_signal(signal.SIGKILL)
        server.wait()
    print("server killed with SIGKILL; restarting on the same file", flush=True)
    server = _serve(db, port)
    store = HttpStoreClient(url)
    try:
        after = await _summary(store, ids)
        print(
            f"after the restart:  {after[0]} succeeded, {after[1]} spans, mean reward "
            f"{after[2]:.2f}"
        )
        if after != before:
            raise SystemExit("the store lost data across the restart")
        print(f"every acknowledged write survived; the store file is {db}")
    finally:
        await store.close()
        stop_serve(server)


def main() -> None:
    folder = Path(os.environ.get("LIGHTNING_DEMO_DIR", ".demo"))
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / f"store-{int(time.time())}.duckdb"
    print(f"store file: {db}")
    asyncio.run(_run(db))


if __name__ == "__main__":
    main()
