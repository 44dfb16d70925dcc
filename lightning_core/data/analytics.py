"""Analytics of a training run's transitions: per-iteration Parquet exports queried with DuckDB.

After each iteration the training flow writes every transition of the iteration to
`<root>/transitions/iteration=<k>/part-0.parquet` (hive partitioning). The store's own DuckDB
file belongs to the store's process, so analytics never touch it: they read these exports, which
any Parquet reader (and later an object store) can serve.

One row per transition, with the facts of its rollout (group, task, episode return, success, tool
calls and errors) repeated on every row of the rollout, so that one file holds an iteration;
episode-level numbers must therefore count each rollout once (the `episodes` view does: one row
per rollout_id). A rollout that produced no transition (its agent failed before calling the LLM)
still counts for the success rate: it is exported as one placeholder row with step -1, zero
tokens, reward 0 and a NULL advantage. The `transitions` view leaves placeholders out; the
`exported_rows` view shows the files as written.

Feedback from production: a `data=episodes` run exports the feedback rows it trained on, each
with the policy version of its episode, to `<root>/feedback/part-0.parquet`; with `archive` (a
production store's archive folder, store/archive.py) the archived feedback joins them. The
`feedback` view holds each row once (by its seq), `live_reward` the reward of each policy
version on live traffic: per episode the mean of its sources' newest values (offline.combine's
default), then their mean over the version's episodes, with a 95 % interval.
"""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lightning_core.algo.prefix import extends
from lightning_core.data.files import write_atomically
from lightning_core.errors import DiskFull, InvalidInput, NotFound
from lightning_core.types import FiniteFloat, Transition

# The step of the single row that stands for a rollout without any transition.
PLACEHOLDER_STEP = -1
PART_FILE = "part-0.parquet"
DEFAULT_DATABASE = "analytics.duckdb"


class Column(NamedTuple):
    name: str
    sql_type: str
    arrow_type: pa.DataType
    nullable: bool
    description: str


# The Parquet schema of an export, in file order; the single source of the files' types, the
# views' types and the validation of rows.
COLUMNS: tuple[Column, ...] = (
    Column("iteration", "INTEGER", pa.int32(), False, "Training iteration (also the partition)."),
    Column("rollout_id", "VARCHAR", pa.string(), False, "Rollout the transition belongs to."),
    Column("attempt_id", "VARCHAR", pa.string(), True, "Attempt that produced it."),
    Column("group_id", "VARCHAR", pa.string(), True, "Group sharing a baseline (GRPO)."),
    Column("task_id", "VARCHAR", pa.string(), True, "Dataset task of the rollout."),
    Column("step", "INTEGER", pa.int32(), False, "Order of the LLM call, from 0; -1: placeholder."),
    Column("agent_name", "VARCHAR", pa.string(), True, "Agent that made the call."),
    Column("prompt_tokens", "INTEGER", pa.int32(), False, "Prompt length in tokens."),
    Column("response_tokens", "INTEGER", pa.int32(), False, "Response length in tokens."),
    Column("reward", "DOUBLE", pa.float64(), False, "Reward the action earned right after it."),
    Column("advantage", "DOUBLE", pa.float64(), True, "Advantage trained on; NULL: none."),
    Column("episode_return", "DOUBLE", pa.float64(), False, "Final reward of the rollout."),
    Column("success", "BOOLEAN", pa.bool_(), False, "Rollout met the caller's success threshold."),
    Column("tool_calls", "INTEGER", pa.int32(), False, "Tool calls made in the rollout."),
    Column("tool_errors", "INTEGER", pa.int32(), False, "Tool calls of the rollout that failed."),
    Column("policy_version", "VARCHAR", pa.string(), True, "Policy version that answered."),
    Column(
        "prefix_break",
        "BOOLEAN",
        pa.bool_(),
        True,
        "The prompt does not extend the previous call of its agent in the attempt, so training "
        "cannot share that call's forward pass (algo/prefix.py); NULL: the agent's first call.",
    ),
    Column(
        "provenance_refused",
        "VARCHAR",
        pa.string(),
        True,
        "Why the rollout's calls were not trained on: another adapter or template answered "
        "than the run served (data/provenance.py); NULL: not refused.",
    ),
    Column(
        "judge_score",
        "DOUBLE",
        pa.float64(),
        True,
        "The judge's score of the rollout in [0, 1] (lightning_core/judge); NULL: not judged.",
    ),
)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)
# The feedback export of a data=episodes run, in file order.
FEEDBACK_COLUMNS: tuple[Column, ...] = (
    Column("seq", "BIGINT", pa.int64(), False, "The store's feedback sequence number."),
    Column("episode_id", "VARCHAR", pa.string(), False, "Production episode it is about."),
    Column("source", "VARCHAR", pa.string(), False, "Who gave it (user, judge, ...)."),
    Column("value", "DOUBLE", pa.float64(), False, "The reward it gives."),
    Column("time", "DOUBLE", pa.float64(), False, "When it happened (epoch seconds)."),
    Column("recorded_at", "DOUBLE", pa.float64(), False, "When the store recorded it."),
    Column("policy_version", "VARCHAR", pa.string(), True, "Policy that served the episode."),
)
FEEDBACK_SCHEMA = pa.schema(
    [pa.field(c.name, c.arrow_type, nullable=c.nullable) for c in FEEDBACK_COLUMNS]
)
FEEDBACK_FILE = Path("feedback") / PART_FILE
# The archive's layout (written by store/archive.py; tests/test_archive.py reads one back).
ARCHIVE_BATCHES = "episodes/batch=*"
ARROW_SCHEMA = pa.schema([pa.field(c.name, c.arrow_type, nullable=c.nullable) for c in COLUMNS])
# Facts of the rollout, repeated on each of its rows: they must agree within a rollout.
ROLLOUT_COLUMNS = (
    "group_id",
    "task_id",
    "episode_return",
    "success",
    "tool_calls",
    "tool_errors",
    "provenance_refused",
    "judge_score",
)


class RolloutFacts(BaseModel):
    """What the caller knows of one rollout of the iteration, beyond its transitions."""

    model_config = ConfigDict(extra="forbid")

    group_id: str | None = Field(None, description="Group sharing a baseline (GRPO).")
    task_id: str | None = Field(None, description="Dataset task of the rollout.")
    episode_return: FiniteFloat = Field(description="Final reward of the rollout.")
    success: bool = Field(
        description="Whether the rollout succeeded; the caller picks the threshold on the return."
    )
    tool_calls: int = Field(0, ge=0, description="Tool calls made in the rollout.")
    tool_errors: int = Field(0, ge=0, description="Tool calls of the rollout that failed.")
    attempt_id: str | None = Field(
        None, description="Attempt that ran; fills the placeholder row of a rollout without calls."
    )
    policy_version: str | None = Field(
        None, description="Policy version the rollout used, where a transition does not say."
    )
    provenance_refused: str | None = Field(
        None, description="Why its calls were refused for their provenance; None: they were not."
    )
    judge_score: FiniteFloat | None = Field(
        None, description="The judge's score of the rollout; None: no judge scored it."
    )

    @model_validator(mode="after")
    def _errors_are_calls(self) -> RolloutFacts:
        if self.tool_errors > self.tool_calls:
            raise ValueError(f"tool_errors ({self.tool_errors}) exceed tool_calls")
        return self


def transition_rows(
    transitions: Iterable[Transition],
    facts: Mapping[str, RolloutFacts | Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Export rows of an iteration: its transitions, plus a placeholder per rollout without any.

    `facts` maps every rollout_id of the iteration to its RolloutFacts (or a dict of them);
    the iteration column is filled in by `export_iteration`.
    """
    by_rollout: dict[str, list[Transition]] = {rollout_id: [] for rollout_id in facts}
    for t in transitions:
        if t.rollout_id not in by_rollout:
            raise InvalidInput(
                f"transition of rollout {t.rollout_id!r} has no facts: pass RolloutFacts for "
                "every rollout of the iteration"
            )
        by_rollout[t.rollout_id].append(t)
    rows: list[dict[str, Any]] = []
    for rollout_id, calls in by_rollout.items():
        try:
            f = RolloutFacts.model_validate(facts[rollout_id])
        except ValidationError as exc:
            raise InvalidInput(f"facts of rollout {rollout_id!r}: {exc}") from exc
        shared = f.model_dump(include=set(ROLLOUT_COLUMNS)) | {"rollout_id": rollout_id}
        if not calls:
            rows.append(
                shared
                | {
                    "attempt_id": f.attempt_id,
                    "step": PLACEHOLDER_STEP,
                    "agent_name": None,
                    "prompt_tokens": 0,
                    "response_tokens": 0,
                    "reward": 0.0,
                    "advantage": None,
                    "policy_version": f.policy_version,
                    "prefix_break": None,
                }
            )
        previous: dict[tuple[str | None, str | None], Transition] = {}
        for t in sorted(calls, key=lambda t: t.step):
            before = previous.get((t.attempt_id, t.agent_name))
            previous[(t.attempt_id, t.agent_name)] = t
            rows.append(
                shared
                | {
                    "attempt_id": t.attempt_id,
                    "step": t.step,
                    "agent_name": t.agent_name,
                    "prompt_tokens": len(t.prompt_token_ids),
                    "response_tokens": len(t.response_token_ids),
                    "reward": t.reward,
                    "advantage": t.advantage,
                    "policy_version": t.policy_version or f.policy_version,
                    "prefix_break": None if before is None else not extends(before, t),
                }
            )
    return rows


# Numbers are cast before the checks that compare them; booleans are left to Arrow, which refuses
# what is not one (a cast to bool would call any non-empty string true).
_NUMPY_TYPES = {"INTEGER": "int64", "DOUBLE": "float64"}


def _validate(frame: pd.DataFrame, iteration: int) -> pd.DataFrame:
    given = set(frame.columns)
    missing = [c for c in COLUMN_NAMES if c not in given and c != "iteration"]
    if missing:
        raise InvalidInput(
            f"export rows lack columns {', '.join(missing)}; build them with transition_rows()"
        )
    unknown = sorted(given - set(COLUMN_NAMES))
    if unknown:
        # A typo'd column must not be dropped silently.
        raise InvalidInput(f"export rows have unknown columns {', '.join(unknown)}")
    if "iteration" in given and (frame["iteration"] != iteration).any():
        raise InvalidInput(f"rows of another iteration in the export of iteration {iteration}")
    frame = frame.assign(iteration=iteration)[list(COLUMN_NAMES)]
    for c in COLUMNS:
        if not c.nullable and frame[c.name].isna().any():
            raise InvalidInput(f"column {c.name} has empty values; it is required on every row")
    numbers = {c.name: _NUMPY_TYPES[c.sql_type] for c in COLUMNS if c.sql_type in _NUMPY_TYPES}
    try:
        cast = frame.astype(numbers)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(
            f"export rows of iteration {iteration} have a wrong type: {exc}"
        ) from exc
    # astype truncates 1.5 to 1 and parses "3": a count must already be a whole number.
    counts = [c.name for c in COLUMNS if c.sql_type == "INTEGER"]
    bent = [name for name in counts if (cast[name] != frame[name]).any()]
    if bent:
        raise InvalidInput(f"columns {', '.join(bent)} must hold whole numbers")
    frame = cast
    for name in ("prompt_tokens", "response_tokens", "tool_calls", "tool_errors"):
        if (frame[name] < 0).any():
            raise InvalidInput(f"column {name} has negative counts")
    if (frame["step"] < PLACEHOLDER_STEP).any():
        raise InvalidInput(f"column step must be >= 0, or {PLACEHOLDER_STEP} for a placeholder")
    per_rollout = frame.groupby("rollout_id", sort=False)
    facts_differ = per_rollout[list(ROLLOUT_COLUMNS)].nunique(dropna=False).max(axis=1) > 1
    if facts_differ.any():
        raise InvalidInput(
            f"rows of rollout {facts_differ.idxmax()!r} disagree on its facts "
            f"({', '.join(ROLLOUT_COLUMNS)})"
        )
    crowded = (frame["step"] == PLACEHOLDER_STEP) & (per_rollout["step"].transform("size") > 1)
    if crowded.any():
        raise InvalidInput(
            f"rollout {frame.loc[crowded, 'rollout_id'].iloc[0]!r} has a placeholder row (step "
            f"{PLACEHOLDER_STEP}) beside transitions; a placeholder must be its only row"
        )
    return frame


def export_iteration(root: Path, iteration: int, rows: list[dict[str, Any]] | pd.DataFrame) -> Path:
    """Write an iteration's rows to `root/transitions/iteration=<k>/part-0.parquet`.

    Exporting an iteration again replaces its file whole, so a retried task is harmless. A full
    disk raises DiskFull and leaves every file as it was, the iteration's earlier export included.
    """
    if iteration < 0:
        raise InvalidInput(f"iteration must be >= 0, got {iteration}")
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame.from_records(rows)
    if frame.empty:
        # Every rollout has a row (a placeholder at least), so no rows means no rollouts; an
        # empty file would list the iteration as exported while it has no episodes.
        raise InvalidInput(f"no rows to export for iteration {iteration}: it ran no rollout")
    frame = _validate(frame, iteration)
    try:
        table = pa.Table.from_pandas(frame, schema=ARROW_SCHEMA, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InvalidInput(
            f"export rows of iteration {iteration} have a wrong type: {exc}"
        ) from exc
    path = Path(root) / "transitions" / f"iteration={iteration}" / PART_FILE
    new_folder = not path.parent.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda f: pq.write_table(table, f))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if new_folder:  # an empty partition folder would only puzzle whoever looks
            with contextlib.suppress(OSError):
                path.parent.rmdir()
        raise DiskFull(_disk_full_message(path, iteration)) from exc
    return path


def _disk_full_message(path: Path, iteration: int) -> str:
    root = path.parents[2]
    free = "unknown"
    with contextlib.suppress(OSError):
        # The nearest folder that exists is on the disk that filled up.
        existing = next(p for p in path.parents if p.exists())
        free = f"{shutil.disk_usage(existing).free:,}"
    return (
        f"no space left on the disk of {root} ({free} bytes free) to export iteration "
        f"{iteration}; nothing half-written was left and earlier exports are untouched. Free "
        "space there (or give the run a run_dir on a larger disk) and run it again: a training "
        "run continues from its last finished iteration with `lightning-rl train --resume <run>`"
    )


def export_feedback(root: Path, rows: list[dict[str, Any]]) -> Path:
    """Write the feedback rows a run trained on (FEEDBACK_COLUMNS each) to
    `root/feedback/part-0.parquet`, whole or not at all; again replaces it."""
    try:
        table = pa.Table.from_pylist(
            [{c.name: row.get(c.name) for c in FEEDBACK_COLUMNS} for row in rows],
            schema=FEEDBACK_SCHEMA,
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InvalidInput(f"feedback rows have a wrong type: {exc}") from exc
    path = Path(root) / FEEDBACK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda f: pq.write_table(table, f))
    return path


def exported_iterations(root: Path) -> list[int]:
    """Iterations that have an export under `root`, in order."""
    found = []
    for part in (Path(root) / "transitions").glob(f"iteration=*/{PART_FILE}"):
        match = re.fullmatch(r"iteration=(\d+)", part.parent.name)
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _create_feedback_views(
    con: duckdb.DuckDBPyConnection, root: Path, archive: Path | None
) -> None:
    typed_empty = ", ".join(f"NULL::{c.sql_type} AS {c.name}" for c in FEEDBACK_COLUMNS)
    names = ", ".join(c.name for c in FEEDBACK_COLUMNS)
    parts = [f"SELECT {typed_empty} WHERE false"]
    exported = root / FEEDBACK_FILE
    if exported.exists():
        parts.append(f"SELECT {names} FROM read_parquet({_sql_string(str(exported))})")
    batches = archive / ARCHIVE_BATCHES if archive is not None else None
    if batches is not None and any(batches.parent.glob(f"{batches.name}/feedback.parquet")):
        # Archived feedback carries no policy version: its episode's rollout row has it.
        files = {
            t: f"read_parquet({_sql_string(str(batches / f'{t}.parquet'))}, "
            "hive_partitioning = false)"
            for t in ("feedback", "rollout_log")
        }
        parts.append(
            f"SELECT f.seq, f.episode_id, f.source, f.value, f.time, f.recorded_at, "
            f"r.policy_version FROM {files['feedback']} f LEFT JOIN (SELECT rollout_id, "
            f"policy_version FROM {files['rollout_log']} QUALIFY row_number() OVER (PARTITION "
            "BY rollout_id ORDER BY log_seq DESC) = 1) r ON r.rollout_id = 'ep-' || f.episode_id"
        )
    # A row both exported by a run and archived since is one row.
    union = " UNION ALL BY NAME ".join(parts)
    con.execute(
        f"CREATE OR REPLACE VIEW feedback AS SELECT {names} FROM ({union}) "
        "QUALIFY row_number() OVER (PARTITION BY seq ORDER BY policy_version NULLS LAST) = 1"
    )
    con.execute(
        """
        CREATE OR REPLACE VIEW live_reward AS
        WITH newest AS (
            SELECT * FROM feedback
            QUALIFY row_number() OVER (PARTITION BY episode_id, source ORDER BY seq DESC) = 1
        ), per_episode AS (
            SELECT episode_id, max(policy_version) AS policy_version, avg(value) AS reward,
                count(*) AS sources
            FROM newest GROUP BY episode_id
        )
        SELECT policy_version,
            count(*) AS episodes,
            sum(sources)::BIGINT AS feedback,
            avg(reward) AS reward_mean,
            1.96 * coalesce(stddev_samp(reward), 0) / sqrt(count(*)) AS reward_ci95
        FROM per_episode
        GROUP BY policy_version
        ORDER BY policy_version NULLS FIRST
        """
    )


def live_reward(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Live reward per policy version (the `live_reward` view), one row each."""
    return con.execute("SELECT * FROM live_reward").df()


def _create_views(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    glob = _sql_string(str(root.resolve() / "transitions" / "*" / "*.parquet"))
    typed_empty = ", ".join(f"NULL::{c.sql_type} AS {c.name}" for c in COLUMNS)
    names = ", ".join(COLUMN_NAMES)
    # read_parquet fails on a glob that matches nothing unless allow_empty, which then yields a
    # lone `empty` column; the union with a typed empty row set keeps the views' columns the same
    # before and after the first export. A view re-reads the glob at every query, so files
    # exported after connect() show up without reconnecting. By name: files exported before a
    # column was added (prefix_break) read it as NULL.
    con.execute(
        f"""
        CREATE OR REPLACE VIEW exported_rows AS
        SELECT {names} FROM (
            SELECT {typed_empty} WHERE false
            UNION ALL BY NAME
            SELECT * FROM read_parquet(
                {glob}, hive_partitioning = true, hive_types = {{'iteration': INTEGER}},
                allow_empty = true, union_by_name = true
            )
        )
        """
    )
    con.execute(
        f"CREATE OR REPLACE VIEW transitions AS "
        f"SELECT * FROM exported_rows WHERE step <> {PLACEHOLDER_STEP}"
    )
    con.execute(
        f"""
        CREATE OR REPLACE VIEW episodes AS
        SELECT iteration, rollout_id,
            any_value(group_id) AS group_id,
            any_value(task_id) AS task_id,
            any_value(episode_return) AS episode_return,
            any_value(success) AS success,
            count(*) FILTER (WHERE step <> {PLACEHOLDER_STEP}) AS actions,
            any_value(tool_calls) AS tool_calls,
            any_value(tool_errors) AS tool_errors,
            max(policy_version) AS policy_version,
            any_value(provenance_refused) AS provenance_refused,
            any_value(judge_score) AS judge_score
        FROM exported_rows
        GROUP BY iteration, rollout_id
        """
    )


def connect(
    root: Path,
    database: Path | Literal[":memory:"] | None = None,
    archive: Path | str | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the views exported_rows, transitions and episodes over `root`,
    and feedback and live_reward over its feedback export and `archive` (a production store's
    archive folder; its batches as they are when connecting).

    `database` is the DuckDB file holding the views (and any table you add): by default
    `root/analytics.duckdb`; ":memory:" keeps nothing, and never contends for the file's lock
    with another process that has it open.
    """
    root = Path(root)
    if not root.is_dir():
        raise NotFound(f"run folder {root} does not exist; pass the folder training exports to")
    target = ":memory:" if database == ":memory:" else str(database or root / DEFAULT_DATABASE)
    try:
        con = duckdb.connect(target)
    except duckdb.IOException as exc:
        raise InvalidInput(
            f"cannot open {target}: {_one_line(exc)}; another process may hold it, "
            "connect with database=':memory:'"
        ) from exc
    _create_views(con, root)
    _create_feedback_views(con, root, Path(archive) if archive is not None else None)
    return con


def _one_line(exc: duckdb.Error) -> str:
    # DuckDB appends the statement with a caret under the culprit, which only reads well on a
    # terminal of its own; the message before it says what went wrong.
    message = str(exc).split("\n\nLINE ", 1)[0]
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def run_sql(con: duckdb.DuckDBPyConnection, sql: str) -> pd.DataFrame:
    """The result of `sql` (the last statement's, if several) as a DataFrame."""
    try:
        return con.execute(sql).df()
    except duckdb.Error as exc:
        raise InvalidInput(f"SQL failed: {_one_line(exc)}") from exc


# Metrics of each iteration: episode-level ones count each rollout once (from `episodes`),
# action-level ones each transition once (from `transitions`). reward_std is the population
# std, as in the advantage estimators. NULL filter = every iteration.
_METRICS_SQL = """
WITH ep AS (
    SELECT iteration,
        avg(episode_return) AS "rollout/reward_mean",
        stddev_pop(episode_return) AS "rollout/reward_std",
        avg(success::DOUBLE) AS "rollout/success_rate",
        avg(actions) AS "rollout/actions_per_episode",
        coalesce(sum(tool_errors)::DOUBLE / nullif(sum(tool_calls), 0), 0.0)
            AS "rollout/tool_error_rate",
        count(*)::DOUBLE AS "rollout/episodes",
        count(provenance_refused)::DOUBLE AS "rollout/provenance_refused",
        avg(judge_score) AS "judge/score_mean"
    FROM episodes WHERE $iteration IS NULL OR iteration = $iteration
    GROUP BY iteration
), tr AS (
    SELECT iteration,
        avg(response_tokens) AS "rollout/tokens_per_action",
        avg(prompt_tokens) AS "rollout/prompt_tokens_per_action",
        avg(advantage) AS "credit/advantage_mean",
        avg(abs(advantage)) AS "credit/advantage_abs_mean",
        avg((advantage = 0)::DOUBLE) AS "credit/zero_advantage_fraction"
    FROM transitions WHERE $iteration IS NULL OR iteration = $iteration
    GROUP BY iteration
)
SELECT ep.iteration,
    "rollout/reward_mean", "rollout/reward_std", "rollout/success_rate",
    "rollout/actions_per_episode", "rollout/tokens_per_action",
    "rollout/prompt_tokens_per_action", "rollout/tool_error_rate", "rollout/episodes",
    "rollout/provenance_refused", "judge/score_mean",
    "credit/advantage_mean", "credit/advantage_abs_mean", "credit/zero_advantage_fraction"
FROM ep LEFT JOIN tr USING (iteration)
ORDER BY ep.iteration
"""


def history(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """The metrics of every exported iteration, one row each in order (a reward curve); a
    judge's columns only where a judge scored some iteration."""
    frame = con.execute(_METRICS_SQL, {"iteration": None}).df()
    unjudged = [c for c in frame if c.startswith("judge/") and frame[c].isna().all()]
    return frame.drop(columns=unjudged)


def iteration_metrics(con: duckdb.DuckDBPyConnection, iteration: int) -> dict[str, float]:
    """Namespaced metrics of one iteration, to log with step=iteration.

    Action-level metrics are NaN when no rollout of the iteration called the LLM.
    """
    frame = con.execute(_METRICS_SQL, {"iteration": iteration}).df()
    if frame.empty:
        exported = con.execute("SELECT DISTINCT iteration FROM episodes ORDER BY 1").fetchall()
        raise NotFound(
            f"no export of iteration {iteration}; exported: "
            f"{', '.join(str(i) for (i,) in exported) or 'none yet'}"
        )
    row = frame.drop(columns="iteration").iloc[0]
    # A judge's metrics exist only in an iteration a judge scored.
    return {
        name: float(value)
        for name, value in row.items()
        if not (name.startswith("judge/") and pd.isna(value))
    }


def agent_breakdown(con: duckdb.DuckDBPyConnection, iteration: int) -> pd.DataFrame:
    """Per agent_name of one iteration: transitions, mean reward and advantage, tokens/action."""
    return con.execute(
        """
        SELECT agent_name,
            count(*) AS transitions,
            avg(reward) AS reward_mean,
            avg(advantage) AS advantage_mean,
            avg(response_tokens) AS tokens_per_action
        FROM transitions WHERE iteration = $iteration
        GROUP BY agent_name
        ORDER BY agent_name NULLS LAST
        """,
        {"iteration": iteration},
    ).df()
