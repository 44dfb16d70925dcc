"""Store throughput: our durable store vs Agent Lightning 0.3.0's, same workload, in one run.

The workload is Agent Lightning's own store benchmark (its tests/benchmark/benchmark_store.py),
reimplemented in `workload.py`: each rollout runs 1..6 rounds; a round is a span with two nested
child spans carrying ~28 random attributes (~5 KB) and, with probability 0.5, a reward; then a
final span and a final reward in [1, 2]. Runners poll the store for work over HTTP on loopback;
the algorithm side enqueues batches, waits for them, and reads every rollout's spans back and
checks them (the task attribute is there, the final reward is in [1, 2]).

Our side: `lightning-rl serve` on a DuckDB file (durable: a write is acknowledged after it is in
the store's write-ahead log and fsynced), 32 runners as coroutines in separate runner
processes, spans of a rollout sent in one `add_spans` call (which the client coalesces across
runners).

    python benchmarks/store_throughput.py            # both stores, prints the table
    python benchmarks/store_throughput.py --skip-peer --total 512
    python benchmarks/store_throughput.py --quick    # the same code on 32 rollouts (the tests)
    python benchmarks/store_throughput.py --prefill 1000000   # a year of episodes stored first

--quick: 32 rollouts in batches of 16, 4 runners in one runner process, both stores on free
ports. Agent Lightning is measured only if its venv is already built (else its row is left
out, said in a line): building it takes a minute and 800 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from benchmarks.workload import WorkloadShape, generate_attributes, rollout_plan  # noqa: E402
from lightning_core import semconv  # noqa: E402
from lightning_core.serving.process import free_port, start_serve, stop_serve  # noqa: E402
from lightning_core.store.client import HttpStoreClient  # noqa: E402
from lightning_core.types import Claim, RolloutRequest, RolloutStatus, Span  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ---------------------------------------------------------------------------- runner side


def _agent_spans(claim: Claim, rng: random.Random, shape: WorkloadShape) -> list[Span]:
    """The spans one rollout of the benchmark agent produces (timings from its sleeps)."""
    spans: list[Span] = []
    trace_id = f"{rng.getrandbits(128):032x}"
    rollout_id, attempt_id = claim.rollout.rollout_id, claim.attempt.attempt_id
    rounds, selected, rewards = rollout_plan(rng, shape.max_rounds)

    def make(name: str, parent: str | None, attributes: dict[str, Any], t0: float) -> Span:
        span = Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            trace_id=trace_id,
            span_id=f"{rng.getrandbits(64):016x}",
            parent_id=parent,
            name=name,
            start_time=t0,
            end_time=time.time(),
            attributes=attributes,
        )
        spans.append(span)
        return span

    def reward(value: float) -> None:
        make(semconv.REWARD_SPAN, None, {semconv.REWARD_VALUE: value}, time.time())

    for i in range(rounds):
        t0 = time.time()
        outer = f"{rng.getrandbits(64):016x}"
        first = generate_attributes(rng)
        if i == selected:
            first["task"] = claim.rollout.input
        make(f"round{i}_1", outer, first, t0)
        make(f"round{i}_2", outer, generate_attributes(rng), time.time())
        spans.append(
            Span(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                trace_id=trace_id,
                span_id=outer,
                name=f"agent{i}",
                start_time=t0,
                end_time=time.time(),
            )
        )
        if rewards[i]:
            reward(rng.uniform(0.0, 1.0))
    make("final", None, generate_attributes(rng), time.time())
    reward(rng.uniform(1.0, 2.0))
    return spans


async def _sleep_like_agent(rng: random.Random, spans: int, sleep_s: float) -> None:
    # The agent sleeps uniform(0, sleep_s) in each of its 2 per-round spans and the final span.
    for _ in range(spans):
        await asyncio.sleep(rng.uniform(0.0, sleep_s))


async def _runner(
    client: HttpStoreClient,
    worker_id: str,
    shape: WorkloadShape,
    stop: asyncio.Event,
    latencies: list[float],
) -> int:
    rng = random.Random(worker_id)
    done = 0
    while not stop.is_set():
        claim = await client.dequeue(worker_id, wait=0.5)
        if claim is None:
            continue
        spans = _agent_spans(claim, rng, shape)
        work_spans = sum(1 for s in spans if s.name.startswith("round") or s.name == "final")
        await _sleep_like_agent(rng, work_spans, shape.sleep_seconds)
        t0 = time.perf_counter()
        await client.add_spans(spans)
        latencies.append(time.perf_counter() - t0)
        await client.complete_attempt(claim.attempt.attempt_id)
        done += 1
    return done


async def _runner_process_main(url: str, shape: WorkloadShape, first: int, count: int, conn):
    client = HttpStoreClient(url)
    stop = asyncio.Event()
    latencies: list[float] = []

    async def watch_parent() -> None:
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        stop.set()

    watcher = asyncio.create_task(watch_parent())
    runners = [_runner(client, f"runner-{first + i}", shape, stop, latencies) for i in range(count)]
    done = await asyncio.gather(*runners)
    watcher.cancel()
    await client.close()
    conn.send({"rollouts": sum(done), "latencies": latencies})


def _runner_process(url: str, shape: WorkloadShape, first: int, count: int, conn) -> None:
    try:
        import uvloop

        uvloop.run(_runner_process_main(url, shape, first, count, conn))
    except ImportError:
        asyncio.run(_runner_process_main(url, shape, first, count, conn))


# ---------------------------------------------------------------------------- algorithm side


def _check(rollout_id: str, task: str, spans: list[Span], episode_return: float | None) -> None:
    if not any(s.attributes.get("task") == task for s in spans):
        raise RuntimeError(f"rollout {rollout_id}: task {task!r} not found in its spans")
    rewards = [s.attributes[semconv.REWARD_VALUE] for s in spans if s.name == semconv.REWARD_SPAN]
    if not rewards or not 1.0 <= rewards[-1] <= 2.0:
        raise RuntimeError(f"rollout {rollout_id}: final reward {rewards[-1:]} not in [1, 2]")
    if episode_return != rewards[-1]:
        raise RuntimeError(
            f"rollout {rollout_id}: episode_return {episode_return} != {rewards[-1]}"
        )


async def _algorithm(url: str, shape: WorkloadShape) -> dict[str, Any]:
    client = HttpStoreClient(url)
    submitted = checked = spans_read = 0
    start = time.perf_counter()
    while submitted < shape.total_rollouts:
        n = min(shape.batch_size, shape.total_rollouts - submitted)
        requests = [RolloutRequest(input=f"task-{submitted + i}") for i in range(n)]
        submitted += n
        batch = {r.rollout_id: r.input for r in await client.enqueue_rollouts(requests)}
        pending = set(batch)
        while pending:
            finished = await client.wait_for_rollouts(sorted(pending), timeout=0.5)
            if not finished:
                continue
            ids = [r.rollout_id for r in finished]
            by_rollout: dict[str, list[Span]] = {i: [] for i in ids}
            for chunk in range(0, len(ids), 256):
                for span in await client.query_spans(ids[chunk : chunk + 256], "latest"):
                    by_rollout[span.rollout_id].append(span)
            for rollout in finished:
                if rollout.status is not RolloutStatus.succeeded:
                    raise RuntimeError(f"rollout {rollout.rollout_id} ended {rollout.status}")
                spans = by_rollout[rollout.rollout_id]
                _check(rollout.rollout_id, batch[rollout.rollout_id], spans, rollout.episode_return)
                spans_read += len(spans)
                checked += 1
            pending.difference_update(ids)
        print(f"  lightning-rl: {checked}/{shape.total_rollouts} rollouts checked", flush=True)
    seconds = time.perf_counter() - start
    await client.close()
    return {"rollouts": checked, "spans": spans_read, "seconds": seconds}


def run_lightning(
    shape: WorkloadShape, runner_processes: int, port: int, prefill: int = 0
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="lightning-bench-"))
    db = workdir / "bench.duckdb"
    if prefill:
        # A year of production traffic already in the store (store_scale.py's episodes).
        from benchmarks.store_scale import WEEK_S
        from benchmarks.store_scale import prefill as fill

        end = time.time()
        print(f"  prefilling the store with {prefill:,} production episodes ...", flush=True)
        fill(db, 0, prefill, end - 52 * WEEK_S, end)
    # Port 0: a free one, picked only now, after the prefill's seconds, in which another
    # process (a parallel test) could have taken one picked earlier.
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_serve(db, port, "--backend", "none", timeout=1800)
    ctx = mp.get_context("spawn")
    processes = []
    try:
        per = [shape.runners // runner_processes] * runner_processes
        for i in range(shape.runners % runner_processes):
            per[i] += 1
        first = 0
        for count in per:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_runner_process, args=(url, shape, first, count, child))
            p.start()
            processes.append((p, parent))
            first += count
        result = asyncio.run(_algorithm(url, shape))
        latencies: list[float] = []
        for _, parent in processes:
            parent.send("stop")
        for p, parent in processes:
            latencies.extend(parent.recv()["latencies"])
            p.join(timeout=30)
        db_bytes = sum(f.stat().st_size for f in workdir.iterdir())
    finally:
        for p, _ in processes:
            if p.is_alive():
                p.kill()
        stop_serve(server)
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "store": "lightning-rl (DuckDB file, durable)",
        "runners": shape.runners,
        **result,
        "rollouts_per_s": result["rollouts"] / result["seconds"],
        "spans_per_s": result["spans"] / result["seconds"],
        "add_span_p50_ms": 1000 * _percentile(latencies, 0.5),
        "add_span_p99_ms": 1000 * _percentile(latencies, 0.99),
        "db_mb": db_bytes / 1e6,
    }


# ---------------------------------------------------------------------------- report


def _table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"| {'store':<38} | runners | rollouts | spans  | seconds | rollouts/s | spans/s "
        "| add-spans p50 ms | add-spans p99 ms |"
    )
    lines = [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
    for r in rows:
        lines.append(
            f"| {r['store']:<38} | {r['runners']:>7} | {r['rollouts']:>8} | {r['spans']:>6} "
            f"| {r['seconds']:>7.1f} | {r['rollouts_per_s']:>10.1f} | {r['spans_per_s']:>7.0f} "
            f"| {r['add_span_p50_ms']:>16.1f} | {r['add_span_p99_ms']:>16.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    defaults = WorkloadShape()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=defaults.total_rollouts)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--max-rounds", type=int, default=defaults.max_rounds)
    parser.add_argument("--sleep-seconds", type=float, default=defaults.sleep_seconds)
    parser.add_argument("--runners", type=int, default=defaults.runners)
    parser.add_argument(
        "--runner-processes", type=int, default=2, help="processes the runners are spread over"
    )
    parser.add_argument("--port", type=int, default=4757)
    parser.add_argument("--peer-port", type=int, default=4748)
    parser.add_argument("--skip-peer", action="store_true", help="measure lightning-rl only")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="production episodes (with spans and feedback) in our store before the run: "
        "1000000 is a year of traffic (benchmarks/store_scale.py)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="32 rollouts, 4 runners, free ports, no peer to build"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.total, args.batch_size, args.runners, args.runner_processes = 32, 16, 4, 1
        args.port, args.peer_port = 0, free_port()  # 0: run_lightning picks it when it starts
        from benchmarks.peers import agentlightning

        if not args.skip_peer and not agentlightning.is_installed():
            print(f"quick: no Agent Lightning row ({agentlightning.venv_dir()} is not built)")
            args.skip_peer = True
    shape = WorkloadShape(
        total_rollouts=args.total,
        batch_size=args.batch_size,
        max_rounds=args.max_rounds,
        sleep_seconds=args.sleep_seconds,
        runners=args.runners,
    )
    print(f"workload: {shape}; machine: {os.cpu_count()} cores", flush=True)
    rows = [run_lightning(shape, args.runner_processes, args.port, args.prefill)]
    if args.prefill:
        rows[0]["store"] = f"lightning-rl + {args.prefill:,} episodes"
    if not args.skip_peer:
        from benchmarks.peers.agentlightning import run_agentlightning

        rows.append(run_agentlightning(shape, port=args.peer_port))
    print()
    print(_table(rows))
    ours = rows[0]["rollouts_per_s"]
    if len(rows) > 1:
        # A store holding a year of episodes first is a figure of its own.
        variant = f"prefill {args.prefill}" if args.prefill else None
        ratio = f"{ours / rows[1]['rollouts_per_s']:.1f}"
        record("ratio_vs_agentlightning", ratio, variant=variant, save=not args.quick)
        p99 = rows[0]["add_span_p99_ms"] / rows[1]["add_span_p99_ms"]
        record(
            "add_spans_p99_vs_agentlightning", f"{p99:.2f}", variant=variant, save=not args.quick
        )
    else:
        print("ratio_vs_agentlightning: not measured (--skip-peer)")
        print("add_spans_p99_vs_agentlightning: not measured (--skip-peer)")


if __name__ == "__main__":
    main()
