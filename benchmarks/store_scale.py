"""The store at the scale of a year: 1,000,000 production episodes with feedback.

A production store gains an episode per user session (with a span per LLM call and its
feedback); a year at 20,000 episodes a week is 1,000,000. This measures, on such a store:
- how long `lightning-rl serve` takes to start on it (it loads every rollout into memory);
- the `data=episodes` plan of a weekly run: the episodes whose feedback arrived in the last
  week, read over HTTP with their spans and turned into transitions (the goal: <= 30 s);
- archiving the episodes idle for longer than the retention window (90 days: three quarters of
  the year) with `POST /store/archive`, and the store file's size before and after;
- the same plan again after the archive; an archived week read back as a plan with
  `data.episodes_archive` reads it; the analytics view of the archived feedback;
- the steady state: `--cycles` more weeks, each appended (server stopped), then archived on a
  restarted server, with the file's size after each: bounded when it stops growing.

The store is filled directly with DuckDB (`prefill`), in the store's own schema, as if the
gateway had recorded the year: each episode has 2 LLM-call spans (48 prompt tokens, 16 response
tokens with their logprobs, about 0.6 KB of attributes each) and one feedback row, spread evenly
over `--weeks` weeks ending now; the policy version changes weekly.

    python benchmarks/store_scale.py                  # 1,000,000 episodes (about 15 min)
    python benchmarks/store_scale.py --episodes 200000
    python benchmarks/store_scale.py --quick          # 2,000 episodes: the same code (the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

from benchmarks.results import record  # noqa: E402
from lightning_core import semconv  # noqa: E402
from lightning_core.data import analytics  # noqa: E402
from lightning_core.data.offline import OfflineConfig  # noqa: E402
from lightning_core.serving.process import free_port, start_serve, stop_serve  # noqa: E402
from lightning_core.store import schema  # noqa: E402
from lightning_core.store.archive import ArchiveReader  # noqa: E402
from lightning_core.store.client import HttpStoreClient  # noqa: E402
from lightning_core.types import Feedback, Rollout, Span, episode_rollout_id  # noqa: E402
from lightning_rl.flows.data_plan import plan_episodes_since  # noqa: E402

WEEK_S = 7 * 86_400.0
PROMPT_TOKENS, RESPONSE_TOKENS, CALLS = 48, 16, 2


def _tokens(seed: str, count: int) -> str:
    return (
        f"'[' || array_to_string(list_transform(range({count}), "
        f"lambda x: (hash({seed}, x) % 49152)::INTEGER), ',') || ']'"
    )


def _logprobs(seed: str, count: int) -> str:
    return (
        f"'[' || array_to_string(list_transform(range({count}), "
        f"lambda x: -round((hash({seed}, x, 7) % 4000) / 1000.0, 3)), ',') || ']'"
    )


def prefill(db: Path, first: int, count: int, start: float, end: float) -> float:
    """Append production episodes u<first> .. u<first+count-1> (rollout, attempt, CALLS spans,
    one feedback each) to the store file `db` (created if new), started evenly over [start,
    end); returns the seconds taken. Ids and sequence numbers follow the episode's index, so
    a later call continues where an earlier one stopped."""
    started = time.perf_counter()
    step = (end - start) / count
    con = duckdb.connect(str(db))
    for table in schema.TABLES:
        con.execute(table.ddl)
    for view in schema.VIEWS:
        con.execute(view)
    # Episode i: started at t(i); log_seq 2i+1 (rollout) and 2i+2 (attempt); spans CALLS*i+k+1;
    # feedback seq i+1, a minute after it started. Its policy is that week's (of the epoch).
    t = f"({start} + (i - {first}) * {step})"
    version = f"'calc-w' || ({t} // {WEEK_S})::BIGINT"
    rows = f"range({first}, {first + count}) r(i)"
    con.execute(
        f"""INSERT INTO rollout_log SELECT 2 * i + 1, 'ep-u' || i,
        '{{"episode_id": "u' || i || '"}}', NULL, NULL, 'production', 'running', {version},
        1, 1, NULL, {t}, {t}, NULL, '{{"agent_name": "calc"}}' FROM {rows}"""
    )
    con.execute(
        f"""INSERT INTO attempt_log SELECT 2 * i + 2, 'at-u' || i, 'ep-u' || i, 1, 'production',
        'running', {t}, NULL, {t}, NULL FROM {rows}"""
    )
    response = semconv.RESPONSE.format(i=0, key="{key}")
    attributes = (
        f"""'{{"{semconv.PROMPT_TOKEN_IDS}": ' || {_tokens("i, k", PROMPT_TOKENS)} || """
        f"""', "{semconv.RESPONSE_COUNT}": 1, "{response.format(key="token_ids")}": ' || """
        f"""{_tokens("i, k, 1", RESPONSE_TOKENS)} || ', "{response.format(key="logprobs")}": ' """
        f"""|| {_logprobs("i, k", RESPONSE_TOKENS)} || ', "{semconv.POLICY_VERSION}": "' || """
        f"""{version} || '", "{semconv.AGENT_NAME}": "calc"}}'"""
    )
    con.execute(
        f"""INSERT INTO spans SELECT {CALLS} * i + k + 1, 'ep-u' || i, 'at-u' || i,
        md5(i::VARCHAR), substr(md5(i::VARCHAR || '-' || k), 1, 16), NULL, 'chat calc', 'server',
        {t} + 5 * k, {t} + 5 * k + 2, 'unset', NULL, {attributes}, '[]', '{{}}'
        FROM {rows}, range({CALLS}) c(k)"""
    )
    con.execute(
        f"""INSERT INTO feedback SELECT i + 1, 'u' || i, 'user', (hash(i, 3) % 2)::DOUBLE,
        {t} + 60, {t} + 60, NULL, '{{}}' FROM {rows}"""
    )
    con.execute("CHECKPOINT")
    con.close()
    return time.perf_counter() - started


def file_mb(db: Path) -> float:
    return sum(p.stat().st_size for p in (db, Path(f"{db}.wal")) if p.exists()) / 1e6


def _rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the store's database worker)."""
    total = 0.0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


def _plan(url: str, after: int, archive: str | None = None) -> tuple[float, int, int]:
    """(seconds, episodes, transitions) of a data=episodes plan from watermark `after`."""
    started = time.perf_counter()
    plan, batch = plan_episodes_since(url, None, after, "calc", OfflineConfig(), None, archive)
    seconds = time.perf_counter() - started
    return seconds, plan.rows, len(batch.transitions) if batch else 0


def _read_archived_week(folder: str, after: int, weekly: int) -> tuple[float, int]:
    """Seconds to read the episodes with feedback seq in (after, after + weekly] back from the
    archive, and how many there were."""
    started = time.perf_counter()
    reader = ArchiveReader(folder)
    try:
        feedback = [Feedback.model_validate(r) for r in reader.feedback(after + weekly, after)]
        ids = sorted({episode_rollout_id(f.episode_id) for f in feedback})
        rollouts = [Rollout.model_validate(r) for r in reader.rollouts(ids)]
        spans = [Span.model_validate(r) for r in reader.spans(ids)]
    finally:
        reader.close()
    assert len(rollouts) == len(ids) and len(spans) == CALLS * len(ids), (len(rollouts), len(spans))
    return time.perf_counter() - started, len(ids)


async def _archive(url: str, days: float) -> Any:
    async with HttpStoreClient(url) as client:
        return await client.archive_episodes(older_than_days=days)


def _start(db: Path, port: int) -> tuple[Any, float]:
    started = time.perf_counter()
    server = start_serve(db, port, "--backend", "none", timeout=1800)
    return server, time.perf_counter() - started


def run(
    episodes: int, weeks: int, retention_days: float, cycles: int, workdir: Path
) -> dict[str, Any]:
    """The year, then `cycles` more weeks: each appended, then archived (the steady state)."""
    db = workdir / "production.duckdb"
    out: dict[str, Any] = {"episodes": episodes, "cycles": []}
    weekly = episodes // weeks
    # The year ends `cycles` weeks ago; each cycle adds the next week, up to now.
    now = time.time()
    year_end = now - cycles * WEEK_S
    print(f"filling {db} with {episodes:,} episodes over {weeks} weeks ...", flush=True)
    out["prefill_s"] = prefill(db, 0, episodes, year_end - weeks * WEEK_S, year_end)
    out["mb_before"] = file_mb(db)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server, out["start_s"] = _start(db, port)
    try:
        out["rss_mb"] = _rss_mb(server.pid)
        print(f"  serving after {out['start_s']:.1f} s, {out['rss_mb']:.0f} MB", flush=True)
        # This week's run: the feedback of the last week is new to it.
        after = episodes - weekly
        out["plan_s"], out["plan_episodes"], out["plan_transitions"] = _plan(url, after)
        print(f"  plan: {out['plan_episodes']} episodes in {out['plan_s']:.1f} s", flush=True)
        # Today is year_end: the window counts back from it.
        report = asyncio.run(_archive(url, retention_days + cycles * 7))
        out["archived"], out["archive_s"] = report.episodes, report.seconds
        out["batches"] = len(report.batches)
        out["mb_after"] = report.file_bytes_after / 1e6
        print(f"  archived {report.episodes:,} in {report.seconds:.1f} s", flush=True)
        out["plan_after_s"], plan_rows, _ = _plan(url, after)
        assert plan_rows == out["plan_episodes"], (plan_rows, out["plan_episodes"])
        # Archived weeks stay readable: one week, 20 weeks back, read from the archive as a
        # plan reads it (feedback, rollouts, spans), into the store's types.
        out["read_week_s"], out["read_week_episodes"] = _read_archived_week(
            report.folder, episodes - 20 * weekly, weekly
        )
        out["rss_after_mb"] = _rss_mb(server.pid)
    finally:
        stop_serve(server)
    out["mb_closed"] = file_mb(db)
    first = episodes
    for cycle in range(1, cycles + 1):
        week_end = year_end + cycle * WEEK_S
        prefill(db, first, weekly, week_end - WEEK_S, week_end)
        first += weekly
        server, restart_s = _start(db, port)
        try:
            report = asyncio.run(_archive(url, retention_days + (cycles - cycle) * 7))
        finally:
            stop_serve(server)
        out["cycles"].append(
            (cycle, restart_s, report.episodes, report.seconds, report.file_bytes_after / 1e6)
        )
        print(f"  week +{cycle}: archived {report.episodes:,}, {file_mb(db):.1f} MB", flush=True)
    out["restart_s"] = out["cycles"][-1][1] if cycles else float("nan")
    con = analytics.connect(workdir, ":memory:", archive=report.folder)
    out["archived_feedback"] = con.execute("SELECT count(*) FROM feedback").fetchone()[0]
    con.close()
    return out


def _table(r: dict[str, Any]) -> str:
    rows = [
        ("episodes stored", f"{r['episodes']:,}"),
        ("prefill (DuckDB, not measured against a goal)", f"{r['prefill_s']:.1f} s"),
        ("serve: start on the store", f"{r['start_s']:.1f} s"),
        ("serve: resident memory (server + worker)", f"{r['rss_mb']:.0f} MB"),
        (
            f"data=episodes plan, last week ({r['plan_episodes']:,} episodes, "
            f"{r['plan_transitions']:,} transitions)",
            f"{r['plan_s']:.1f} s",
        ),
        (
            f"archive ({r['archived']:,} episodes, {r['batches']} batches)",
            f"{r['archive_s']:.1f} s",
        ),
        ("store file before", f"{r['mb_before']:.1f} MB"),
        ("store file after archive + checkpoint", f"{r['mb_after']:.1f} MB"),
        ("store file after the server closed", f"{r['mb_closed']:.1f} MB"),
        ("serve: resident memory after archive", f"{r['rss_after_mb']:.0f} MB"),
        ("data=episodes plan, last week, after archive", f"{r['plan_after_s']:.1f} s"),
        (
            f"an archived week read back ({r['read_week_episodes']:,} episodes with spans)",
            f"{r['read_week_s']:.1f} s",
        ),
        ("archived feedback rows seen by analytics", f"{r['archived_feedback']:,}"),
    ]
    for cycle, restart_s, archived, seconds, mb in r["cycles"]:
        rows.append(
            (
                f"week +{cycle}: restart {restart_s:.1f} s, archived {archived:,} "
                f"in {seconds:.1f} s, file",
                f"{mb:.1f} MB",
            )
        )
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'measure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1_000_000)
    parser.add_argument("--weeks", type=int, default=52)
    parser.add_argument("--retention-days", type=float, default=90.0)
    parser.add_argument(
        "--cycles", type=int, default=3, help="weeks added and archived after the year"
    )
    parser.add_argument("--workdir", help="Where the store is built (default: a temp folder).")
    parser.add_argument("--quick", action="store_true", help="2,000 episodes (the tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes = 2000
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lightning-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores", flush=True)
    try:
        result = run(args.episodes, args.weeks, args.retention_days, args.cycles, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(_table(result))
    scale = "1m" if args.episodes == 1_000_000 else "quick" if args.quick else "n"
    save = not args.quick
    # The figures of another size than a year's are figures of their own.
    variant = None if args.episodes == 1_000_000 else f"episodes {args.episodes}"
    record(f"plan_episodes_{scale}_s", f"{result['plan_s']:.1f}", save=save)
    record("archive_s", f"{result['archive_s']:.1f}", variant=variant, save=save)
    record("store_mb_before", f"{result['mb_before']:.1f}", variant=variant, save=save)
    record("store_mb_after", f"{result['mb_after']:.1f}", variant=variant, save=save)


if __name__ == "__main__":
    main()
