"""What the SQL agent's greedy final queries are, with and without its SQL grammar.

    .venv/bin/python benchmarks/sql_greedy.py [--split test] [--arms free,grammar]
    .venv/bin/python benchmarks/sql_greedy.py --run runs/latest

Serves the base model with `lightning-rl serve` (transformers backend, this CPU), runs the
agent (writer, checker, rewriter; temperature 0) on every question of the split once per arm
and sorts each final query by what running it gives: right (execution match), rows but
wrong, no rows, or failed (with SQLite's error). `free` is the agent as before its grammar
(`SQLAgentConfig.constrain = False`), `grammar` decodes the writer and rewriter under
agents/sql/grammar.py. Accuracy per tier comes with Wilson 95 % intervals.

With `--run`, nothing is served: the same table for a finished `lightning-rl train --agent sql`
run, base and final policy, from the held-out rollouts in its store (each one's last query is
the last writer or rewriter reply).

    .venv/bin/python benchmarks/sql_greedy.py --quick   # the same code in seconds (the tests)

--quick serves the tiny random model instead of SmolLM2 and asks the first 2 questions of the
split, both arms, with every reply cut at 32 tokens (the checker's at 16); its queries are noise
(nearly all "failed"), the code path is the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time
from pathlib import Path

import duckdb

from lightning_core import semconv
from lightning_core.models import DEFAULT_MODEL, TINY_MODEL
from lightning_core.serving.process import free_port, start_serve, stop_serve
from lightning_core.stats.evaluation import wilson_interval
from lightning_core.types import LLMEndpoint
from lightning_rl.agents.sql import tool
from lightning_rl.agents.sql.agent import SQLAgentConfig, solve
from lightning_rl.agents.sql.data import load_tasks
from lightning_rl.agents.sql.reward import sql_reward
from lightning_rl.agents.sql.sql_text import extract_sql

ARMS = {"free": False, "grammar": True}
OUTCOMES = ("right", "rows, wrong", "no rows", "failed")


def outcome(task: dict, sql: str) -> tuple[str, str]:
    """(one of OUTCOMES, SQLite's error class for a failed query)."""
    if sql_reward(sql, task) >= 1.0:
        return "right", ""
    try:
        result = tool.run_sql(task["db"], sql, tool.MAX_ROWS, tool.TIMEOUT_MS)
    except tool.SQLError as exc:
        # "no such column: x" -> "no such column": the class, not the name.
        return "failed", str(exc).split(":")[0].strip()[:40] or "empty"
    return ("rows, wrong" if result.rows else "no rows"), ""


async def run_arm(
    tasks: list[dict],
    endpoint: LLMEndpoint,
    constrain: bool,
    concurrency: int,
    **agent_config: int,
):
    gate = asyncio.Semaphore(concurrency)
    config = SQLAgentConfig(constrain=constrain, **agent_config)

    async def one(task: dict) -> tuple[str, str, str]:
        async with gate:
            final = await solve(task, endpoint, config)
        sql = final.get("sql", "")
        kind, error = await asyncio.to_thread(outcome, task, sql)
        return task["tier"], kind, error

    return await asyncio.gather(*(one(t) for t in tasks))


def report(arm: str, rows: list[tuple[str, str, str]], seconds: float | None = None) -> None:
    took = f", {seconds:.0f} s" if seconds is not None else ""
    print(f"\n## {arm} ({len(rows)} questions{took})\n")
    print("| tier | tasks | right | accuracy (95 % CI) |")
    print("|---|---:|---:|---|")
    tiers = [*sorted({r[0] for r in rows}), "all"]
    for tier in tiers:
        mine = [r for r in rows if tier in ("all", r[0])]
        right = sum(r[1] == "right" for r in mine)
        low, high = wilson_interval(right, len(mine))
        print(
            f"| {tier} | {len(mine)} | {right} | {right / len(mine):.1%} ({low:.1%}–{high:.1%}) |"
        )
    counts = collections.Counter(r[1] for r in rows)
    print("\n| " + " | ".join(OUTCOMES) + " |\n|" + "---:|" * len(OUTCOMES))
    print("| " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    errors = collections.Counter(r[2] for r in rows if r[1] == "failed")
    if errors:
        print("\nfailed: " + ", ".join(f"{e} {n}" for e, n in errors.most_common()))


def from_run(run: Path, split: str = "test") -> dict[str, list[tuple[str, str, str]]]:
    """Policy version -> (tier, outcome, error) per task of held-out `split`, for the run's base
    and final policies, read from its store (a run with evaluation.extra_splits holds the
    evaluations of every split it scored; the split's task ids pick one)."""
    ids = {t["id"] for t in load_tasks(split, 1_000_000)}
    summary = json.loads((run / "summary.json").read_text())
    versions = [summary["base"]["policy_version"], summary["final"]["policy_version"]]
    agent = json.dumps(semconv.AGENT_NAME)
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        rollouts = con.execute(
            "SELECT rollout_id, policy_version, input FROM rollouts "
            "WHERE mode = 'test' AND policy_version IN (?, ?)",
            versions,
        ).fetchall()
        replies = con.execute(
            "SELECT rollout_id, json_extract_string(attributes, '$.\"gen_ai.output.messages\"') "
            f"FROM spans WHERE json_extract_string(attributes, '$.{agent}') IN "
            "('writer', 'rewriter') ORDER BY rollout_id, end_time, sequence_id"
        ).fetchall()
    last: dict[str, str] = {}
    for rollout_id, messages in replies:
        message = json.loads(messages or "[{}]")
        message = message[0] if isinstance(message, list) else message
        last[rollout_id] = message.get("content") or ""
    out: dict[str, list[tuple[str, str, str]]] = {v: [] for v in versions}
    for rollout_id, version, raw in rollouts:
        task = json.loads(raw)
        if task["id"] not in ids:
            continue
        kind, error = outcome(task, extract_sql(last.get(rollout_id, "")))
        out[version].append((task["tier"], kind, error))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=("train", "test", "kinds"), default="test")
    parser.add_argument("--arms", default="free,grammar", help="Comma-separated: free, grammar.")
    parser.add_argument("--concurrency", type=int, default=8, help="Questions at once.")
    parser.add_argument(
        "--run", type=Path, help="A finished sql training run's folder: read, nothing served."
    )
    parser.add_argument("--size", type=int, default=10_000, help="Questions of the split asked.")
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 questions")
    args = parser.parse_args(argv)
    serve_options: tuple[str, ...] = ()
    model, agent_config = DEFAULT_MODEL, {}
    if args.quick:
        args.size, serve_options, model = 2, ("--model", "tiny"), TINY_MODEL
        agent_config = {"sql_max_tokens": 32, "check_max_tokens": 16}
    if args.run is not None:
        if not (args.run / "summary.json").is_file():
            parser.error(f"{args.run} has no summary.json: not a finished training run")
        print(f"SQL agent, greedy, run {args.run.resolve().name}, held-out split {args.split}")
        for version, rows in from_run(args.run, args.split).items():
            report(version, rows)
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms takes free and/or grammar, not {unknown or 'nothing'}")
    tasks = load_tasks(args.split, args.size)
    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        server = start_serve(Path(scratch) / "store.duckdb", port, *serve_options)
        try:
            endpoint = LLMEndpoint(
                base_url=f"http://127.0.0.1:{port}/v1",
                model=model,
                sampling={"temperature": 0},
            )
            print(f"SQL agent, greedy base {model}, {args.split} split")
            for arm in arms:
                started = time.monotonic()
                rows = asyncio.run(
                    run_arm(tasks, endpoint, ARMS[arm], args.concurrency, **agent_config)
                )
                report(arm, rows, time.monotonic() - started)
        finally:
            stop_serve(server)


if __name__ == "__main__":
    main()
