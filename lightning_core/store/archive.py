"""Moving old production episodes out of the store into Parquet files, crash-safely.

Runs in the database worker process (worker.py), on its DuckDB connection, between two group
commits. A batch of episodes is moved in three steps, each of which a SIGKILL may interrupt:

1. copy: every row of the batch's episodes (rollout and attempt logs, spans, feedback) up to the
   given bounds is written with DuckDB's COPY into `<archive>/.staging/<batch>/`, one Parquet
   file per table, plus `manifest.json`; each file and the folder are fsynced;
2. publish: the folder is renamed to `<archive>/episodes/batch=<batch>/` (one atomic rename,
   then the parent fsynced): readers see the whole batch or nothing of it;
3. delete: one transaction deletes those rows from the store and records the batch in
   `archive_batches`.

Killed in step 1, a staging folder is left, which the next start removes: the rows are still in
the store, nothing is lost. Killed between 2 and 3, the published batch has no row in
`archive_batches`: the next start (`recover`) deletes its rows from the store then, reading
which from the batch's own files, so nothing is kept twice. The bounds (log_seq, span
sequence_id, feedback seq) confine each step to the rows that existed when the batch was chosen:
an episode id opened again later starts a new episode whose rows stay.

Readers: the analytics views read `episodes/batch=*/feedback.parquet` (data/analytics.py), and a
`data=episodes` plan reads the batches' feedback, rollouts and spans (flows/data_plan.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from lightning_core.types import EPISODE_ROLLOUT_PREFIX

EPISODES_FOLDER = "episodes"
STAGING_FOLDER = ".staging"
MANIFEST = "manifest.json"
BATCH_PREFIX = "batch="
# (table, key column, the bound's column, the bound's name): what a batch holds of each table.
# Feedback is keyed by episode id, the rest by rollout id (`ep-<episode id>`).
MOVED = (
    ("rollout_log", "rollout_id", "log_seq", "log_seq"),
    ("attempt_log", "rollout_id", "log_seq", "log_seq"),
    ("spans", "rollout_id", "sequence_id", "span_seq"),
    ("feedback", "episode_id", "seq", "feedback_seq"),
)
_IDS_VIEW = "_lightning_archive_ids"

Step = Callable[[str], None]


def batch_folder(archive: Path, batch: str) -> Path:
    return archive / EPISODES_FOLDER / f"{BATCH_PREFIX}{batch}"


def sql_string(text: str) -> str:
    """`text` as a SQL string literal (paths in COPY and read_parquet take no parameters)."""
    return "'" + text.replace("'", "''") + "'"


def fsync_path(path: Path) -> None:
    """Make a file's content, or a folder's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _where(key: str, seq_column: str, bound: int) -> str:
    return f"{key} IN (SELECT {key} FROM {_IDS_VIEW}) AND {seq_column} <= {int(bound)}"


def _register_ids(con: Any, rollout_ids: list[str]) -> None:
    episode_ids = [r.removeprefix(EPISODE_ROLLOUT_PREFIX) for r in rollout_ids]
    con.register(_IDS_VIEW, pa.table({"rollout_id": rollout_ids, "episode_id": episode_ids}))


def _delete(con: Any, manifest: dict[str, Any], rollout_ids: list[str]) -> None:
    """Step 3: the batch's rows out of the store and the batch recorded, in one transaction."""
    _register_ids(con, rollout_ids)
    bounds = manifest["bounds"]
    statements = ["BEGIN"]
    for table, key, seq_column, bound in MOVED:
        statements.append(f"DELETE FROM {table} WHERE {_where(key, seq_column, bounds[bound])}")
    statements.append(
        "INSERT INTO archive_batches VALUES ("
        f"{sql_string(manifest['batch'])}, {float(manifest['archived_at'])}, "
        f"{int(manifest['episodes'])}, {int(bounds['log_seq'])}, {int(bounds['span_seq'])}, "
        f"{int(bounds['feedback_seq'])})"
    )
    statements.append("COMMIT")
    try:
        con.execute("; ".join(statements))
    except Exception:
        con.execute("ROLLBACK")
        raise
    finally:
        con.unregister(_IDS_VIEW)


def archive_batch(
    con: Any,
    archive: Path,
    batch: str,
    rollout_ids: list[str],
    bounds: dict[str, int],
    archived_at: float,
    step: Step | None = None,
) -> dict[str, int]:
    """Move the rows of these episodes (rollout ids `ep-...`) up to `bounds` into a new
    archive batch; returns the rows moved per table. `step` is called after each step
    (the crash tests kill the process there)."""
    step = step or (lambda _name: None)
    staging = archive / STAGING_FOLDER / batch
    final = batch_folder(archive, batch)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _register_ids(con, rollout_ids)
    counts: dict[str, int] = {}
    try:
        for table, key, seq_column, bound in MOVED:
            path = staging / f"{table}.parquet"
            select = (
                f"SELECT * FROM {table} WHERE {_where(key, seq_column, bounds[bound])} "
                f"ORDER BY {seq_column}"
            )
            counts[table] = con.execute(
                f"COPY ({select}) TO {sql_string(str(path))} (FORMAT parquet)"
            ).fetchone()[0]
            fsync_path(path)
            step(f"copied {table}")
    finally:
        con.unregister(_IDS_VIEW)
    manifest = {
        "batch": batch,
        "archived_at": archived_at,
        "episodes": len(rollout_ids),
        "bounds": bounds,
        "rows": counts,
    }
    with open(staging / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(staging)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, final)
    fsync_path(final.parent)
    step("published")
    _delete(con, manifest, rollout_ids)
    step("deleted")
    return counts


def recover(con: Any, archive: Path) -> list[str]:
    """Finish what a killed archive left: remove staging folders, and delete from the store the
    rows of every published batch not yet recorded as deleted. Returns those batches."""
    shutil.rmtree(archive / STAGING_FOLDER, ignore_errors=True)
    folder = archive / EPISODES_FOLDER
    if not folder.is_dir():
        return []
    done = {row[0] for row in con.execute("SELECT batch FROM archive_batches").fetchall()}
    finished = []
    for path in sorted(folder.glob(f"{BATCH_PREFIX}*/{MANIFEST}")):
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest["batch"] in done:
            continue
        rollouts = sql_string(str(path.parent / "rollout_log.parquet"))
        ids = [
            row[0]
            for row in con.execute(
                f"SELECT DISTINCT rollout_id FROM read_parquet({rollouts})"
            ).fetchall()
        ]
        _delete(con, manifest, ids)
        finished.append(manifest["batch"])
    return finished


def checkpoint(con: Any) -> None:
    """Write the WAL into the file and give back the blocks the deleted rows held: DuckDB 2.0
    reuses freed blocks for new rows and truncates free blocks at the file's end, so a store
    archived on a schedule stays near a steady size (BENCHMARKS.md, store at scale)."""
    con.execute("CHECKPOINT")


# ---------------------------------------------------------------------------- reading it back


class ArchiveReader:
    """The archived episodes, read as the store answers for live ones (a data=episodes plan
    reads both). Reads the published batches only; nothing here writes."""

    def __init__(self, archive: str | Path) -> None:
        import duckdb

        self.folder = Path(archive)
        self._con = duckdb.connect(":memory:")

    def _glob(self, table: str) -> str | None:
        """The table's files, as read_parquet's arguments (None: no batch yet). Not as hive
        partitions: the rows are the store's, without a `batch` column."""
        pattern = f"{BATCH_PREFIX}*/{table}.parquet"
        if not any((self.folder / EPISODES_FOLDER).glob(pattern)):
            return None
        files = sql_string(str(self.folder / EPISODES_FOLDER / pattern))
        return f"{files}, hive_partitioning = false"

    def _rows(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        from lightning_core.store import schema

        cursor = self._con.execute(sql, params)
        columns = [d[0] for d in cursor.description]
        return [schema.row_dict(columns, row) for row in cursor.fetchall()]

    def feedback(
        self,
        through_seq: int,
        after_seq: int = 0,
        episode_ids: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        """As the store's query_feedback: the newest row per (episode, source) up to
        `through_seq` of the episodes with a row in (after_seq, through_seq], or of
        `episode_ids`."""
        glob = self._glob("feedback")
        if glob is None:
            return []
        sql = (
            f"SELECT * FROM read_parquet({glob}) WHERE seq <= $through "
            "QUALIFY row_number() OVER (PARTITION BY episode_id, source ORDER BY seq DESC) = 1"
        )
        if episode_ids is not None:
            where, params = "episode_id IN (SELECT unnest($ids))", {"ids": episode_ids}
        else:
            where = (
                f"episode_id IN (SELECT episode_id FROM read_parquet({glob}) "
                "WHERE seq > $after AND seq <= $through)"
            )
            params = {"after": after_seq}
        return self._rows(
            f"SELECT * FROM ({sql}) WHERE {where} ORDER BY episode_id, source",
            {"through": through_seq, **params},
        )

    def rollouts(self, rollout_ids: list[str]) -> list[dict[str, Any]]:
        """The latest row of each of these rollouts that is archived."""
        glob = self._glob("rollout_log")
        if glob is None or not rollout_ids:
            return []
        return self._rows(
            f"SELECT * FROM read_parquet({glob}) WHERE rollout_id IN (SELECT unnest($ids)) "
            "QUALIFY row_number() OVER (PARTITION BY rollout_id ORDER BY log_seq DESC) = 1 "
            "ORDER BY rollout_id",
            {"ids": rollout_ids},
        )

    def spans(self, rollout_ids: list[str]) -> list[dict[str, Any]]:
        """The spans of these archived rollouts, each once, as first stored."""
        glob = self._glob("spans")
        if glob is None or not rollout_ids:
            return []
        return self._rows(
            f"SELECT * EXCLUDE (sequence_id), sequence_id FROM read_parquet({glob}) "
            "WHERE rollout_id IN (SELECT unnest($ids)) QUALIFY row_number() OVER (PARTITION BY "
            "attempt_id, trace_id, span_id ORDER BY sequence_id) = 1 ORDER BY sequence_id",
            {"ids": rollout_ids},
        )

    def close(self) -> None:
        self._con.close()
