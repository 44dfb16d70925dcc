"""DuckDB tables of the store and the conversions between their rows and the data model.

Rollouts and attempts are append-only logs (one row per change, `log_seq` orders them) with views
that show the latest row of each: appends are the cheapest durable write DuckDB has, and the log
doubles as an audit trail of every status change. Feedback on production episodes is such a log
too: one row per recorded change, `seq` orders them, the newest per (episode, source) counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa

from lightning_core.types import Attempt, Feedback, PolicyVersion, Rollout, Span, Transition

_ARROW = {
    "BIGINT": pa.int64(),
    "INTEGER": pa.int32(),
    "DOUBLE": pa.float64(),
    "VARCHAR": pa.string(),
    "JSON": pa.string(),
    "INTEGER[]": pa.list_(pa.int32()),
    "DOUBLE[]": pa.list_(pa.float64()),
}


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[tuple[str, str], ...]

    @property
    def ddl(self) -> str:
        cols = ", ".join(f"{name} {sql_type}" for name, sql_type in self.columns)
        return f"CREATE TABLE IF NOT EXISTS {self.name} ({cols})"

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([(name, _ARROW[sql_type]) for name, sql_type in self.columns])

    def to_arrow(self, rows: list[tuple[Any, ...]]) -> pa.Table:
        columns = list(zip(*rows, strict=True))
        return pa.Table.from_arrays(
            [
                pa.array(col, type=t)
                for col, t in zip(columns, self.arrow_schema.types, strict=False)
            ],
            schema=self.arrow_schema,
        )


ROLLOUT_LOG = Table(
    "rollout_log",
    (
        ("log_seq", "BIGINT"),
        ("rollout_id", "VARCHAR"),
        ("input", "JSON"),
        ("task_id", "VARCHAR"),
        ("group_id", "VARCHAR"),
        ("mode", "VARCHAR"),
        ("status", "VARCHAR"),
        ("policy_version", "VARCHAR"),
        ("max_attempts", "INTEGER"),
        ("attempt_count", "INTEGER"),
        ("episode_return", "DOUBLE"),
        ("enqueued_at", "DOUBLE"),
        ("started_at", "DOUBLE"),
        ("ended_at", "DOUBLE"),
        ("metadata", "JSON"),
    ),
)

ATTEMPT_LOG = Table(
    "attempt_log",
    (
        ("log_seq", "BIGINT"),
        ("attempt_id", "VARCHAR"),
        ("rollout_id", "VARCHAR"),
        ("sequence_id", "INTEGER"),
        ("worker_id", "VARCHAR"),
        ("status", "VARCHAR"),
        ("started_at", "DOUBLE"),
        ("ended_at", "DOUBLE"),
        ("last_heartbeat_at", "DOUBLE"),
        ("error", "VARCHAR"),
    ),
)

SPANS = Table(
    "spans",
    (
        ("sequence_id", "BIGINT"),
        ("rollout_id", "VARCHAR"),
        ("attempt_id", "VARCHAR"),
        ("trace_id", "VARCHAR"),
        ("span_id", "VARCHAR"),
        ("parent_id", "VARCHAR"),
        ("name", "VARCHAR"),
        ("kind", "VARCHAR"),
        ("start_time", "DOUBLE"),
        ("end_time", "DOUBLE"),
        ("status_code", "VARCHAR"),
        ("status_message", "VARCHAR"),
        ("attributes", "JSON"),
        ("events", "JSON"),
        ("resource", "JSON"),
    ),
)

TRANSITIONS = Table(
    "transitions",
    (
        ("rollout_id", "VARCHAR"),
        ("attempt_id", "VARCHAR"),
        ("step", "INTEGER"),
        ("agent_name", "VARCHAR"),
        ("prompt_token_ids", "INTEGER[]"),
        ("response_token_ids", "INTEGER[]"),
        ("response_logprobs", "DOUBLE[]"),
        ("reward", "DOUBLE"),
        ("advantage", "DOUBLE"),
        ("policy_version", "VARCHAR"),
        ("output_constraint", "JSON"),
        ("temperature", "DOUBLE"),
        ("top_p", "DOUBLE"),
        ("finish_reason", "VARCHAR"),
        ("adapter_hash", "VARCHAR"),
        ("template_fingerprint", "VARCHAR"),
    ),
)

# How transitions are read back: one per (rollout, attempt, step), the last written. A collect
# task retried after its answer was lost stores its transitions again; reads never double them.
TRANSITIONS_LATEST = (
    "QUALIFY row_number() OVER (PARTITION BY rollout_id, attempt_id, step ORDER BY rowid DESC) = 1"
)
# Their read order, one row per key value: pages of a read resume after the last row's key.
TRANSITIONS_KEY = "(rollout_id, step, coalesce(attempt_id, ''))"

POLICY_VERSIONS = Table(
    "policy_versions",
    (
        ("name", "VARCHAR"),
        ("base_model", "VARCHAR"),
        ("adapter_path", "VARCHAR"),
        ("created_at", "DOUBLE"),
        ("metadata", "JSON"),
        ("agent_policies", "JSON"),
    ),
)

# Append-only: a new value of an (episode, source) is a new row with the next `seq`, never an
# update, so a training run that read up to seq S finds exactly what came after it, late
# feedback on old episodes included, by reading seq > S.
FEEDBACK = Table(
    "feedback",
    (
        ("seq", "BIGINT"),
        ("episode_id", "VARCHAR"),
        ("source", "VARCHAR"),
        ("value", "DOUBLE"),
        ("time", "DOUBLE"),
        ("recorded_at", "DOUBLE"),
        ("comment", "VARCHAR"),
        ("metadata", "JSON"),
    ),
)

# The newest row per (episode, source) among rows up to a seq (the first parameter).
LATEST_FEEDBACK = (
    "SELECT * FROM feedback WHERE seq <= ? "
    "QUALIFY row_number() OVER (PARTITION BY episode_id, source ORDER BY seq DESC) = 1"
)

# One row per batch of episodes moved to the archive (archive.py), written in the transaction
# that deletes them from the store. It says which archive folders are complete (a folder without
# its row is finished at the next start), and it keeps the counters: once the newest rows are
# archived, the next log_seq, span sequence_id and feedback seq still come after theirs, so a
# watermark a training run took is never handed out again.
ARCHIVE_BATCHES = Table(
    "archive_batches",
    (
        ("batch", "VARCHAR"),
        ("archived_at", "DOUBLE"),
        ("episodes", "BIGINT"),
        ("log_seq", "BIGINT"),
        ("span_seq", "BIGINT"),
        ("feedback_seq", "BIGINT"),
    ),
)

# Tables are created with CREATE TABLE IF NOT EXISTS, so a table added since a release (feedback)
# is simply created in a database made before it.
TABLES = (ROLLOUT_LOG, ATTEMPT_LOG, SPANS, TRANSITIONS, POLICY_VERSIONS, FEEDBACK, ARCHIVE_BATCHES)
# Columns added since a table was first released, for databases created before them: added
# last, so that positional inserts line up.
MIGRATIONS = (
    "ALTER TABLE transitions ADD COLUMN IF NOT EXISTS output_constraint JSON",
    "ALTER TABLE transitions ADD COLUMN IF NOT EXISTS temperature DOUBLE DEFAULT 1.0",
    "ALTER TABLE transitions ADD COLUMN IF NOT EXISTS top_p DOUBLE DEFAULT 1.0",
    "ALTER TABLE transitions ADD COLUMN IF NOT EXISTS finish_reason VARCHAR",
    "ALTER TABLE transitions ADD COLUMN IF NOT EXISTS adapter_hash VARCHAR",
    "ALTER TABLE transitions ADD COLUMN IF NOT EXISTS template_fingerprint VARCHAR",
    "ALTER TABLE policy_versions ADD COLUMN IF NOT EXISTS agent_policies JSON DEFAULT '{}'",
)

# Columns renamed since release, (table, old name, new name): renamed in databases that still
# have the old one, before the views are made (the glossary's names, docs/glossary.md).
RENAMES = (("rollout_log", "final_reward", "episode_return"),)

VIEWS = (
    "CREATE OR REPLACE VIEW rollouts AS SELECT * EXCLUDE (log_seq) FROM rollout_log "
    "QUALIFY row_number() OVER (PARTITION BY rollout_id ORDER BY log_seq DESC) = 1",
    "CREATE OR REPLACE VIEW attempts AS SELECT * EXCLUDE (log_seq) FROM attempt_log "
    "QUALIFY row_number() OVER (PARTITION BY attempt_id ORDER BY log_seq DESC) = 1",
)


# orjson reads JSON up to 1024 levels deep but writes at most 254: a body nested deeper than
# MAX_JSON_DEPTH could be stored but not written back out (a rollout's input inside a list of
# rollouts, a chat message on a span), so it is refused as it arrives.
MAX_JSON_DEPTH = 200
_ORJSON_WRITE_DEPTH = 254


def check_json_depth(value: Any, doc: str = "") -> None:
    """Raise a JSONDecodeError (the HTTP API answers it as malformed JSON, a 400) if `value` nests
    deeper than MAX_JSON_DEPTH. Writing it once under the missing levels finds out: 7 ms for
    1.5 MB of spans, a third of parsing them, where a walk in Python takes 50 ms."""
    wrapped = value
    for _ in range(_ORJSON_WRITE_DEPTH - MAX_JSON_DEPTH):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        raise json.JSONDecodeError(
            f"nested deeper than {MAX_JSON_DEPTH} levels; flatten the value", doc, 0
        ) from None


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def rollout_row(seq: int, r: Rollout) -> tuple[Any, ...]:
    return (
        seq,
        r.rollout_id,
        _json(r.input),
        r.task_id,
        r.group_id,
        r.mode.value,
        r.status.value,
        r.policy_version,
        r.max_attempts,
        r.attempt_count,
        r.episode_return,
        r.enqueued_at,
        r.started_at,
        r.ended_at,
        _json(r.metadata),
    )


def attempt_row(seq: int, a: Attempt) -> tuple[Any, ...]:
    return (
        seq,
        a.attempt_id,
        a.rollout_id,
        a.sequence_id,
        a.worker_id,
        a.status.value,
        a.started_at,
        a.ended_at,
        a.last_heartbeat_at,
        a.error,
    )


def span_row(s: Span, sequence_id: int) -> tuple[Any, ...]:
    return (
        sequence_id,
        s.rollout_id,
        s.attempt_id,
        s.trace_id,
        s.span_id,
        s.parent_id,
        s.name,
        s.kind.value,
        s.start_time,
        s.end_time,
        s.status_code.value,
        s.status_message,
        _json(s.attributes),
        _json([e.model_dump() for e in s.events]),
        _json(s.resource),
    )


def transition_row(t: Transition) -> tuple[Any, ...]:
    return (
        t.rollout_id,
        t.attempt_id,
        t.step,
        t.agent_name,
        t.prompt_token_ids,
        t.response_token_ids,
        t.response_logprobs,
        t.reward,
        t.advantage,
        t.policy_version,
        _json(t.output_constraint.model_dump()) if t.output_constraint is not None else None,
        t.temperature,
        t.top_p,
        t.finish_reason,
        t.adapter_hash,
        t.template_fingerprint,
    )


def policy_version_row(p: PolicyVersion) -> tuple[Any, ...]:
    return (
        p.name,
        p.base_model,
        p.adapter_path,
        p.created_at,
        _json(p.metadata),
        _json(p.agent_policies),
    )


def feedback_row(f: Feedback) -> tuple[Any, ...]:
    return (
        f.seq,
        f.episode_id,
        f.source,
        f.value,
        f.time,
        f.recorded_at,
        f.comment,
        _json(f.metadata),
    )


JSON_FIELDS = frozenset(
    {"input", "metadata", "attributes", "events", "resource", "output_constraint", "agent_policies"}
)


def row_dict(columns: list[str], row: tuple[Any, ...]) -> dict[str, Any]:
    """A result row as a dict, its JSON columns parsed."""
    out = dict(zip(columns, row, strict=True))
    for key in JSON_FIELDS.intersection(out):
        if out[key] is not None:
            out[key] = orjson.loads(out[key])
    out.pop("log_seq", None)
    return out
