"""Retention: idle production episodes move from the store to its Parquet archive.

What must hold: only episodes idle since the cutoff move (a call or feedback after it keeps an
episode live); every row of a moved episode is in the archive once and gone from the store; the
feedback watermark never goes back (a restart after the newest feedback was archived hands out
higher seqs); a process SIGKILLed at any step of an archive loses and duplicates nothing, once
the store has started again on the file; a data=episodes plan reads archived episodes, and can
take each episode once; the analytics views hold the archived feedback and the runs' exports
once each; compacting a stopped store gives the space back and keeps its data; and feedback
waits for the episode's calls in flight.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.data import analytics
from lightning_core.data.offline import OfflineConfig
from lightning_core.errors import InvalidInput, NotFound
from lightning_core.serving.process import start_serve, stop_serve
from lightning_core.store import archive
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import FeedbackIn, Span, episode_rollout_id
from lightning_rl.flows.data_plan import plan_episodes_since
from tests.conftest import ThreadedServer, free_port
from tests.helpers import run_cli

TABLES = [name for name, *_ in archive.MOVED]


def call_span(attempt, n: int) -> Span:
    """An LLM call's span as the gateway records it: tokens and logprobs a plan trains on."""
    return Span(
        rollout_id=attempt.rollout_id,
        attempt_id=attempt.attempt_id,
        trace_id=f"{n:032x}",
        span_id=f"{n:016x}",
        name="chat",
        start_time=time.time(),
        end_time=time.time(),
        attributes={
            semconv.PROMPT_TOKEN_IDS: [1, 2, n % 50],
            semconv.RESPONSE_COUNT: 1,
            semconv.RESPONSE.format(i=0, key="token_ids"): [7, 8],
            semconv.RESPONSE.format(i=0, key="logprobs"): [-0.5, -0.25],
            semconv.POLICY_VERSION: "v1",
        },
    )


async def fill(store: DuckDBStore, episodes: list[str], start: int = 0) -> None:
    """Each episode: two calls (spans) and feedback from one source, as production makes them."""
    for i, episode_id in enumerate(episodes):
        attempt = await store.open_episode(episode_id, agent_name="calc")
        await store.add_spans([call_span(attempt, 2 * (start + i) + 1)])
        await store.add_spans([call_span(attempt, 2 * (start + i) + 2)])
        await store.add_feedback(episode_id, FeedbackIn(value=1.0, source="user"))


def archived_ids(folder: Path) -> list[str]:
    files = sorted(folder.glob("episodes/batch=*/rollout_log.parquet"))
    if not files:
        return []
    glob = [str(f) for f in files]
    return [r[0] for r in duckdb.sql(f"SELECT rollout_id FROM read_parquet({glob})").fetchall()]


def live_ids(db: Path) -> list[str]:
    with duckdb.connect(str(db), read_only=True) as con:
        return [r[0] for r in con.execute("SELECT rollout_id FROM rollout_log").fetchall()]


async def test_idle_episodes_move_to_the_archive_and_stay_readable(tmp_path):
    db = tmp_path / "store.duckdb"
    store = DuckDBStore(db=str(db), archive_batch_episodes=2)
    old = [f"old-{i}" for i in range(5)]
    await fill(store, old)
    await asyncio.sleep(0.5)
    # Active after the cutoff: a new call on one old episode, new feedback on another, a new one.
    cutoff_days = 0.3 / 86_400
    attempt = await store.open_episode("old-0")
    await store.add_spans([call_span(attempt, 1000)])
    await store.add_feedback("old-1", FeedbackIn(value=0.0, source="judge"))
    await fill(store, ["new-0"], start=500)
    watermark = await store.feedback_watermark()

    report = await store.archive_episodes(older_than_days=cutoff_days)
    assert report.episodes == 3 and len(report.batches) == 2
    assert report.rows == {"rollout_log": 3, "attempt_log": 3, "spans": 6, "feedback": 3}
    for episode_id in ("old-2", "old-3", "old-4"):
        with pytest.raises(NotFound):
            await store.get_episode(episode_id)
    for episode_id in ("old-0", "old-1", "new-0"):
        await store.get_episode(episode_id)
    # Nothing more is idle: a second archive moves nothing.
    assert (await store.archive_episodes(older_than_days=cutoff_days)).episodes == 0
    assert await store.feedback_watermark() == watermark
    await store.close()

    folder = Path(report.folder)
    assert folder == Path(f"{db}.archive")
    assert sorted(archived_ids(folder)) == [episode_rollout_id(f"old-{i}") for i in (2, 3, 4)]
    assert not set(archived_ids(folder)) & set(live_ids(db))
    feedback = duckdb.sql(
        f"SELECT episode_id, value FROM read_parquet('{folder}/episodes/*/feedback.parquet')"
    ).fetchall()
    assert sorted(feedback) == [("old-2", 1.0), ("old-3", 1.0), ("old-4", 1.0)]

    # The newest feedback is archived next: after a restart, seqs still go up.
    store = DuckDBStore(db=str(db))
    await asyncio.sleep(0.3)
    report = await store.archive_episodes(older_than_days=0.2 / 86_400)
    assert report.episodes == 3
    assert await store.feedback_watermark() == watermark
    await store.close()
    store = DuckDBStore(db=str(db))
    assert await store.feedback_watermark() == watermark
    await fill(store, ["after-restart"], start=900)
    assert await store.feedback_watermark() == watermark + 1
    await store.close()


async def test_an_archive_needs_a_window_and_a_folder(tmp_path):
    store = DuckDBStore(db=":memory:")
    with pytest.raises(InvalidInput, match="no retention window"):
        await store.archive_episodes()
    with pytest.raises(InvalidInput, match="archive folder"):
        await store.archive_episodes(older_than_days=1)
    await store.close()


# A process that archives every episode of the store in one batch, the way the worker does, and
# stops dead (sleeps, to be SIGKILLed) after the step named in argv[3].
_ARCHIVER = """
import sys, time, duckdb
from pathlib import Path
from lightning_core.store import archive
db, folder, stop_after = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
con = duckdb.connect(db)
ids = [r[0] for r in con.execute("SELECT DISTINCT rollout_id FROM rollout_log").fetchall()]
def said(name):
    # Written whole, then renamed: the test reads it as soon as it exists.
    Path(folder.parent / "stopped.part").write_text(name)
    Path(folder.parent / "stopped.part").replace(folder.parent / "stopped")
def step(name):
    if name == stop_after:
        said(name)
        time.sleep(600)
big = 2**62
bounds = {"log_seq": big, "span_seq": big, "feedback_seq": big}
archive.archive_batch(con, folder, "b1", ids, bounds, time.time(), step)
said("end")
time.sleep(600)
"""


@pytest.mark.parametrize(
    "stop_after",
    ["copied rollout_log", "copied spans", "copied feedback", "published", "deleted"],
)
async def test_an_archive_killed_at_any_step_loses_and_duplicates_nothing(tmp_path, stop_after):
    db = tmp_path / "store.duckdb"
    folder = Path(f"{db}.archive")
    store = DuckDBStore(db=str(db))
    await fill(store, [f"ep-{i}" for i in range(20)])
    await store.close()
    before = sorted(set(live_ids(db)))

    archiver = subprocess.Popen([sys.executable, "-c", _ARCHIVER, str(db), str(folder), stop_after])
    try:
        for _ in range(600):
            if (tmp_path / "stopped").exists() or archiver.poll() is not None:
                break
            time.sleep(0.1)
        assert (tmp_path / "stopped").read_text() == stop_after
        archiver.send_signal(signal.SIGKILL)
        archiver.wait(timeout=30)
    finally:
        archiver.kill()

    # The store's start finishes (or forgets) what the killed archive left.
    store = DuckDBStore(db=str(db))
    live = {r.rollout_id for r in await store.query_rollouts()}
    await store.close()
    moved = archived_ids(folder)
    assert not (folder / archive.STAGING_FOLDER).exists()
    assert len(moved) == len(set(moved))  # each episode's log row, once
    assert sorted(live | set(moved)) == before
    assert not live & set(moved)
    published = stop_after in ("published", "deleted")
    assert (sorted(set(moved)), sorted(live)) == ((before, []) if published else ([], before))


@pytest.mark.timeout(300)
async def test_the_archive_command_archives_through_a_running_server(tmp_path):
    db = tmp_path / "store.duckdb"
    store = DuckDBStore(db=str(db))
    await fill(store, [f"conv-{i}" for i in range(4)])
    await store.close()
    await asyncio.sleep(0.5)
    port = free_port()
    key = "archive-key-1"
    key_file = tmp_path / "key"
    key_file.write_text(key)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    server = start_serve(db, port, "--backend", "none", env={**env, "LIGHTNING_API_KEY": key})
    try:
        url = f"http://127.0.0.1:{port}"
        # Without the key: refused, one line, no traceback.
        done = run_cli("data", "archive", "--server", url, "--older-than-days", "0.000003")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        done = run_cli(
            "data", "archive", "--server", url, "--older-than-days", "-1",
            "--key-file", str(key_file),
        )  # fmt: skip
        assert done.returncode == 2 and "must be > 0" in done.stderr
        # No window given and none configured on the server.
        done = run_cli("data", "archive", "--server", url, "--key-file", str(key_file))
        assert done.returncode == 2 and "no retention window" in done.stderr, done.stderr
        done = run_cli(
            "data", "archive", "--server", url, "--key-file", str(key_file),
            "--older-than-days", "0.000003",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"archived 4 episodes in 1 batches to {db}.archive" in done.stdout
        assert "spans" in done.stdout and "store file" in done.stdout
        async with HttpStoreClient(url, api_key=key) as client:
            assert await client.query_rollouts() == []
    finally:
        stop_serve(server)


def test_a_plan_reads_archived_episodes_and_can_take_each_episode_once(tmp_path):
    db = tmp_path / "store.duckdb"
    folder = f"{db}.archive"

    def plan(after: int, archive: str | None = folder, once: bool = False):
        found, batch = plan_episodes_since(
            url, None, after, "calc", OfflineConfig(), None, archive, once
        )
        return found.rows, sorted(e["episode_id"] for e in batch.episodes) if batch else []

    with ThreadedServer(create_app(DuckDBStore(db=str(db)))) as server:
        url = server.url

        async def setup() -> None:
            async with HttpStoreClient(url) as client:
                for i, episode_id in enumerate(["a", "b", "c"]):
                    attempt = await client.open_episode(episode_id)
                    await client.add_spans(
                        [call_span(attempt, 2 * i), call_span(attempt, 2 * i + 1)]
                    )
                    await client.add_feedback(episode_id, FeedbackIn(value=float(i % 2)))
                await asyncio.sleep(0.5)
                attempt = await client.open_episode("d")
                await client.add_spans([call_span(attempt, 10)])
                await client.add_feedback("d", FeedbackIn(value=1.0))  # seq 4
                report = await client.archive_episodes(older_than_days=0.3 / 86_400)
                assert report.episodes == 3

        asyncio.run(setup())
        assert plan(0, archive=None) == (1, ["d"])
        assert plan(0) == (4, ["a", "b", "c", "d"])
        assert plan(3) == (1, ["d"])

        async def late_feedback() -> None:
            async with HttpStoreClient(url) as client:
                await client.add_feedback("d", FeedbackIn(value=0.0, source="judge"))  # seq 5

        asyncio.run(late_feedback())
        assert plan(4) == (1, ["d"])
        assert plan(4, once=True) == (0, [])
        # Once, from the start: nothing was taken before, everything is new.
        assert plan(0, once=True)[0] == 4


async def test_feedback_of_runs_and_archive_in_the_analytics_views(tmp_path):
    db = tmp_path / "store.duckdb"
    store = DuckDBStore(db=str(db))
    await fill(store, ["a", "b"])
    await store.add_feedback("b", FeedbackIn(value=0.0, source="judge"))
    await asyncio.sleep(0.5)
    report = await store.archive_episodes(older_than_days=0.3 / 86_400)
    assert report.episodes == 2
    await store.close()
    run = tmp_path / "run"
    run.mkdir()
    # A run trained on episode b's user feedback (seq 2, also archived since) and on a live
    # episode c served by v2.
    exported = [
        {"seq": 2, "episode_id": "b", "source": "user", "value": 1.0, "time": 1.0,
         "recorded_at": 1.0, "policy_version": "v1"},
        {"seq": 9, "episode_id": "c", "source": "user", "value": 0.5, "time": 2.0,
         "recorded_at": 2.0, "policy_version": "v2"},
    ]  # fmt: skip
    analytics.export_feedback(run, exported)
    con = analytics.connect(run, ":memory:", archive=report.folder)
    rows = con.execute("SELECT seq, episode_id, source, policy_version FROM feedback ORDER BY seq")
    # fill's spans say v1, but the episodes' rollouts carry no policy version: archived rows
    # without one take the run's where it has the same row.
    assert rows.fetchall() == [
        (1, "a", "user", None),
        (2, "b", "user", "v1"),
        (3, "b", "judge", None),
        (9, "c", "user", "v2"),
    ]
    live = con.execute("SELECT policy_version, episodes, feedback, reward_mean FROM live_reward")
    # Episode b: the mean of user 1.0 and judge 0.0.
    assert live.fetchall() == [(None, 1, 1, 1.0), ("v1", 1, 2, 0.5), ("v2", 1, 1, 0.5)]
    con.close()
    con = analytics.connect(run, ":memory:")
    text = report_markdown(live=analytics.live_reward(con))
    con.close()
    assert "## Live reward per policy version" in text and "| v2 | 1 | 1 | 0.500 |" in text


def report_markdown(live) -> str:
    from lightning_rl.flows import report

    curve = report.reward_curve(pd.DataFrame(), [], Path(tempfile.mkdtemp()) / "c.png", "t")
    return report.markdown("t", pd.DataFrame(), [], curve, live=live)


async def test_feedback_waits_for_the_episodes_calls_in_flight(tmp_path):
    store = DuckDBStore(db=str(tmp_path / "store.duckdb"))
    attempt = await store.open_episode("talk")
    # The gateway counts a call when it admits it, and ends it just before staging its span.
    ended = store.episode_call(attempt.rollout_id)
    given = asyncio.create_task(store.add_feedback("talk", FeedbackIn(value=1.0)))
    await asyncio.sleep(0.3)
    assert not given.done(), "feedback was recorded while the episode's call was in flight"
    ended()
    ended()  # twice is harmless
    store.add_spans_nowait([call_span(attempt, 1)])
    receipt = await given
    # Its seq came after the span: a plan that reads this feedback reads the span with it.
    assert receipt.status == "recorded"
    assert [s.span_id for s in await store.query_spans([attempt.rollout_id])] == [f"{1:016x}"]
    # With no call in flight, feedback does not wait; past feedback_wait_s it does not either.
    await store.add_feedback("talk", FeedbackIn(value=0.0, source="judge"))
    store.config.feedback_wait_s = 0.1
    store.episode_call(attempt.rollout_id)
    assert (await store.add_feedback("talk", FeedbackIn(value=1.0, source="judge"))).status == (
        "replaced"
    )
    await store.close()


async def test_compacting_a_stopped_store_gives_back_the_archived_space(tmp_path):
    db = tmp_path / "store.duckdb"
    store = DuckDBStore(db=str(db))
    for i in range(200):
        # 20 KB of text that does not compress: 4 MB in all, well over DuckDB's block sizes.
        attempt = await store.open_episode(f"e{i}")
        big = call_span(attempt, 5000 + i)
        big.attributes["text"] = os.urandom(10_000).hex()
        await store.add_spans([big])
    await asyncio.sleep(0.5)
    await fill(store, ["kept"], start=1000)
    watermark = await store.feedback_watermark()
    assert (await store.archive_episodes(older_than_days=0.3 / 86_400)).episodes == 200
    # Refused while the store's worker holds the file: one line, no traceback.
    done = run_cli("data", "compact", str(db))
    assert done.returncode == 2 and "Stop the server" in done.stderr, done.stderr
    await store.close()
    before = db.stat().st_size
    done = run_cli("data", "compact", str(db))
    assert done.returncode == 0, done.stderr
    assert db.stat().st_size < before
    # The same store: its episode, its counters, and it takes new work.
    store = DuckDBStore(db=str(db))
    assert [r.rollout_id for r in await store.query_rollouts()] == ["ep-kept"]
    assert len(await store.query_spans(["ep-kept"])) == 2
    assert await store.feedback_watermark() == watermark
    await fill(store, ["after"], start=2000)
    assert await store.feedback_watermark() == watermark + 1
    await store.close()
