"""Agent Lightning 0.3.0's side of the store-throughput benchmark; runs in Agent Lightning's venv.

Reproduces the batch mode of Agent Lightning's own `tests/benchmark/benchmark_store.py` on the
shape in `benchmarks/workload.py`: a `Trainer` with `n_runners` runner processes and
`ClientServerExecutionStrategy(managed_store=False)` against a separately started
`agl store --backend memory` server; the algorithm enqueues batches, polls
`wait_for_rollouts(timeout=0)`, reads every finished rollout's spans back and checks them.

It writes one JSON object (see `_summary`) to `--out`. `benchmarks/peers/agentlightning.py`
starts the server, runs this script and reads the JSON from our own environment.

Add-span latency: with a `LightningStoreClient`, Agent Lightning's default `AgentOpsTracer`
does not call the client's `add_span`; it switches the AgentOps `BatchSpanProcessor`'s exporter
(a `LightningStoreOTLPExporter`) to the server's `/v1/traces`, so runners send spans as OTLP/HTTP
batches from the processor's thread. We time each `export` call that targets the store, and
also `add_span`/`add_otel_span` on the client in case a path uses them (a rollout that returns
spans or a reward, or a store without OTLP), and report the distribution over all such calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import functools
import json
import os
import random
import shutil
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Python puts this script's folder first on sys.path, and that folder holds our own
# `agentlightning.py` (the driver), which would shadow the real package: put this venv's
# site-packages ahead of it (none of its top-level names is a standard-library module's), and
# the parent `benchmarks/` folder, for the shared workload, at the end.
sys.path.insert(0, sysconfig.get_paths()["purelib"])
sys.path.append(str(Path(__file__).resolve().parent.parent))

import agentlightning as agl
from agentlightning.utils.otel import get_tracer
from agentlightning.utils.otlp import LightningStoreOTLPExporter
from workload import generate_attributes, rollout_plan

STORE_NAME = f"agentlightning {getattr(agl, '__version__', '?')}"

# A rollout batch that makes no progress for this long means a wedged runner or server: fail
# with a message rather than sit until the caller's subprocess timeout.
STALL_SECONDS = 300.0

# ---------------------------------------------------------------------------------------------
# Runner-side timing of span writes.
#
# Runner processes are forked by ClientServerExecutionStrategy (the default start method on
# Linux; its runner target is a closure, so it cannot use spawn), so patches installed here
# before `Trainer.fit` are inherited. multiprocessing children leave through os._exit, which
# skips atexit, so each process appends its timings to its own file as it goes rather than at
# exit. One O_APPEND write of one short line per call costs microseconds, against milliseconds
# for the HTTP request being timed, and happens outside the timed region.
# ---------------------------------------------------------------------------------------------

_timing_dir: Path | None = None
_timing_fds: dict[int, int] = {}
_timing_lock = threading.Lock()
# add_otel_span calls add_span: time only the outermost call so one span is one sample.
_in_timed_call: contextvars.ContextVar[bool] = contextvars.ContextVar("in_timed", default=False)


def _record(path: str, seconds: float, n_spans: int) -> None:
    if _timing_dir is None:
        return
    pid = os.getpid()
    with _timing_lock:
        fd = _timing_fds.get(pid)
        if fd is None:
            # Keyed by pid: a descriptor inherited through fork would mix two processes' lines.
            fd = os.open(_timing_dir / f"{pid}.tsv", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            _timing_fds[pid] = fd
    os.write(fd, f"{path}\t{seconds:.9f}\t{n_spans}\n".encode())


def _install_timing(timing_dir: Path) -> None:
    global _timing_dir
    _timing_dir = timing_dir

    original_export = LightningStoreOTLPExporter.export

    @functools.wraps(original_export)
    def export(self: Any, spans: Sequence[Any]) -> Any:
        # Without a rollout the exporter bypasses the store and returns at once: not a write.
        if self.rollout_id is None or self.attempt_id is None:
            return original_export(self, spans)
        started = time.perf_counter()
        try:
            return original_export(self, spans)
        finally:
            _record("otlp_export", time.perf_counter() - started, len(spans))

    LightningStoreOTLPExporter.export = export  # type: ignore[method-assign]

    def wrap_async(name: str) -> None:
        original = getattr(agl.LightningStoreClient, name)

        @functools.wraps(original)
        async def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _in_timed_call.get():
                return await original(self, *args, **kwargs)
            token = _in_timed_call.set(True)
            started = time.perf_counter()
            try:
                return await original(self, *args, **kwargs)
            finally:
                _record(f"client.{name}", time.perf_counter() - started, 1)
                _in_timed_call.reset(token)

        setattr(agl.LightningStoreClient, name, timed)

    for name in ("add_span", "add_otel_span"):
        wrap_async(name)
    # add_many_spans loops over add_span in 0.3.0, so its spans are already counted one by one.


def _read_timings(timing_dir: Path) -> tuple[list[float], dict[str, int], int]:
    durations: list[float] = []
    calls: dict[str, int] = {}
    spans = 0
    for file in timing_dir.glob("*.tsv"):
        for line in file.read_text().splitlines():
            path, seconds, n_spans = line.split("\t")
            durations.append(float(seconds))
            calls[path] = calls.get(path, 0) + 1
            spans += int(n_spans)
    return durations, calls, spans


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    # Inclusive method: the p99 of a small sample stays within the observed values.
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


# ---------------------------------------------------------------------------------------------
# The agent: the workload of Agent Lightning's benchmark, with workload.py's generators.
# ---------------------------------------------------------------------------------------------


def make_agent(max_rounds: int, sleep_seconds: float) -> Any:
    @agl.rollout
    async def agent(task: str, llm: agl.LLM) -> None:
        # Seeded by the task, so a rollout's shape does not depend on which runner takes it, and
        # forked runners do not share the random state they inherited.
        rng = random.Random(task)
        tracer = get_tracer()
        rounds, selected, rewards = rollout_plan(rng, max_rounds)
        for i in range(rounds):
            with tracer.start_as_current_span(f"agent{i}"):
                with tracer.start_as_current_span(f"round{i}_1") as span:
                    await asyncio.sleep(rng.uniform(0.0, sleep_seconds))
                    span.set_attributes(generate_attributes(rng))
                    if i == selected:
                        span.set_attribute("task", task)
                with tracer.start_as_current_span(f"round{i}_2") as span:
                    await asyncio.sleep(rng.uniform(0.0, sleep_seconds))
                    span.set_attributes(generate_attributes(rng))
            if rewards[i]:
                agl.emit_reward(rng.uniform(0.0, 1.0))
        with tracer.start_as_current_span("final") as span:
            await asyncio.sleep(rng.uniform(0.0, sleep_seconds))
            span.set_attributes(generate_attributes(rng))
        agl.emit_reward(rng.uniform(1.0, 2.0))

    return agent


def check_spans(spans: Sequence[agl.Span], task: str) -> None:
    """Same acceptance rule as Agent Lightning's benchmark: task present, final reward in [1, 2]."""
    if not any(span.attributes.get("task") == task for span in spans):
        raise ValueError(f"task {task!r} is not in the rollout's {len(spans)} spans")
    reward = agl.find_final_reward(spans)
    if reward is None or not 1.0 <= reward <= 2.0:
        raise ValueError(f"final reward {reward!r} of task {task!r} is not in [1, 2]")


class BatchAlgorithm(agl.Algorithm):
    """Agent Lightning's `algorithm_batch`, timed from the first enqueue to the last check."""

    def __init__(self, total_rollouts: int, batch_size: int, poll_seconds: float) -> None:
        super().__init__()
        self.total_rollouts = total_rollouts
        self.batch_size = batch_size
        self.poll_seconds = poll_seconds
        self.rollouts = 0
        self.spans = 0
        self.seconds = 0.0

    async def run(
        self,
        train_dataset: agl.Dataset[Any] | None = None,
        val_dataset: agl.Dataset[Any] | None = None,
    ) -> None:
        store = self.get_store()
        started = time.perf_counter()
        submitted = 0
        while submitted < self.total_rollouts:
            # As Agent Lightning's benchmark does: new resources for each batch, then the batch.
            await store.add_resources(
                {"llm": agl.LLM(endpoint=f"http://localhost:{submitted}/v1", model="bench")}
            )
            pending: dict[str, str] = {}
            for _ in range(min(self.batch_size, self.total_rollouts - submitted)):
                task = f"task-{submitted}-generated"
                rollout = await store.enqueue_rollout(input=task, mode="train")
                pending[rollout.rollout_id] = task
                submitted += 1
            batch_ids = list(pending)
            last_progress = time.perf_counter()
            while pending:
                finished = await store.wait_for_rollouts(rollout_ids=batch_ids, timeout=0.0)
                progressed = False
                for rollout in finished:
                    task = pending.pop(rollout.rollout_id, None)
                    if task is None:
                        continue  # checked on an earlier poll
                    if rollout.status != "succeeded":
                        raise RuntimeError(f"rollout {rollout.rollout_id} ended {rollout.status}")
                    spans = await store.query_spans(rollout.rollout_id, attempt_id="latest")
                    check_spans(spans, task)
                    self.rollouts += 1
                    self.spans += len(spans)
                    progressed = True
                if not pending:
                    # Agent Lightning's loop sleeps once more after the batch is done; that is
                    # idle time, not store work, so the clock and the next batch do not wait.
                    break
                now = time.perf_counter()
                if progressed:
                    last_progress = now
                elif now - last_progress > STALL_SECONDS:
                    workers = await store.query_workers()
                    raise RuntimeError(
                        f"no rollout finished for {STALL_SECONDS:.0f} s; {len(pending)} pending; "
                        f"workers: {workers}"
                    )
                await asyncio.sleep(self.poll_seconds)
        self.seconds = time.perf_counter() - started


def _summary(
    args: argparse.Namespace, algorithm: BatchAlgorithm, timing_dir: Path
) -> dict[str, Any]:
    durations, calls, timed_spans = _read_timings(timing_dir)
    p50 = _percentile(durations, 50)
    p99 = _percentile(durations, 99)
    seconds = algorithm.seconds
    return {
        "store": STORE_NAME,
        "runners": args.runners,
        "rollouts": algorithm.rollouts,
        "spans": algorithm.spans,
        "seconds": round(seconds, 3),
        "rollouts_per_s": round(algorithm.rollouts / seconds, 2) if seconds else None,
        "spans_per_s": round(algorithm.spans / seconds, 1) if seconds else None,
        "add_span_p50_ms": round(p50 * 1000, 3) if p50 is not None else None,
        "add_span_p99_ms": round(p99 * 1000, 3) if p99 is not None else None,
        # Context for the two figures above: which calls were timed, and how many spans one
        # call carried on average (an OTLP export sends a batch of spans in one request).
        "add_span_calls": calls,
        "spans_per_add_call": round(timed_spans / len(durations), 2) if durations else None,
        "poll_seconds": args.poll_seconds,
        "shape": {
            "total_rollouts": args.total_rollouts,
            "batch_size": args.batch_size,
            "max_rounds": args.max_rounds,
            "sleep_seconds": args.sleep_seconds,
        },
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-url", default="http://127.0.0.1:4747")
    parser.add_argument("--total-rollouts", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--max-rounds", type=int, default=6)
    parser.add_argument("--sleep-seconds", type=float, default=0.001)
    parser.add_argument("--runners", type=int, default=32)
    # Agent Lightning's benchmark polls every 5 s. Finished rollouts then wait for the next poll,
    # which measures the polling interval more than the store, so we poll more often by default;
    # pass --poll-seconds 5 to reproduce its figures.
    parser.add_argument("--poll-seconds", type=float, default=0.5)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for name in ("total_rollouts", "batch_size", "max_rounds", "runners"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.sleep_seconds < 0 or args.poll_seconds <= 0:
        parser.error("--sleep-seconds must be >= 0 and --poll-seconds > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    agl.setup_logging(args.log_level)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Beside the output: the driver's scratch folder, which it removes even when it has to kill
    # this process before the `finally` below runs.
    timing_dir = Path(tempfile.mkdtemp(prefix="agl-add-span-", dir=args.out.parent))
    _install_timing(timing_dir)
    store = agl.LightningStoreClient(args.store_url)
    algorithm = BatchAlgorithm(args.total_rollouts, args.batch_size, args.poll_seconds)
    try:
        trainer = agl.Trainer(
            store=store,
            algorithm=algorithm,
            n_runners=args.runners,
            strategy=agl.ClientServerExecutionStrategy(managed_store=False),
        )
        trainer.fit(make_agent(args.max_rounds, args.sleep_seconds))
        if algorithm.rollouts != args.total_rollouts:
            raise RuntimeError(f"{algorithm.rollouts} of {args.total_rollouts} rollouts checked")
        summary = _summary(args, algorithm, timing_dir)
    finally:
        asyncio.run(store.close())
        shutil.rmtree(timing_dir, ignore_errors=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
