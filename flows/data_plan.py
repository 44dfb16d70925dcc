"""What a training run trains on, decided before it starts: its data plan.

A run of `data=profile` trains on the agent's train split, as always. A recurring run takes only
what is new since the previous run of its kind:

- `new_tasks`: the task table's files after the one the previous `new_tasks` run read last
  (online RL: new rollouts through the agent on those tasks);
- `episodes`: the production episodes whose feedback arrived after the previous `episodes` run's
  feedback watermark, each with its reward combined from its feedback up to this run's
  watermark (offline training). Feedback recorded after the watermark belongs to the next run,
  so every feedback row is taken by exactly one run.

"Previous run" is the newest finished MLflow run of the agent tagged `data.complete` (a run
sets it once it has trained, evaluated and gone through the promotion gate, promoted or not),
and what it read is its tag `data.tasks.through` or `data.feedback.through`. A plan is saved
in the run folder, so a resumed run trains on exactly the data it started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from lightning_core.data import analytics
from lightning_core.data.adapter import AdapterConfig
from lightning_core.data.files import write_text_atomically
from lightning_core.data.offline import OfflineBatch, episode_batch
from lightning_core.data.task_table import TaskTable, content_hash
from lightning_core.errors import InvalidInput, LightningError
from lightning_core.store.archive import ArchiveReader
from lightning_core.types import Feedback, Rollout, Span, Transition, episode_rollout_id
from lightning_rl.policy_server import store_client
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.datasets import previous_run_tag

PLAN_FILE = "data_plan.json"
TASKS_FILE = "train_tasks.json"
EPISODES_FILE = "episodes.json"
TAG_COMPLETE = "data.complete"
TAG_SOURCE = "data.source"
WATERMARK_TAGS = {"new_tasks": "data.tasks.through", "episodes": "data.feedback.through"}
# The store answers at most 10,000 ids per query (issue 13's limits).
_QUERY_CHUNK = 5000


class DataPlan(BaseModel):
    """The data one run trains on, and how to find it again."""

    source: Literal["profile", "new_tasks", "episodes"]
    name: str = Field(description="Dataset name: the task table's folder, or <agent>-episodes.")
    dataset_id: str = Field(description="<name>@<first 12 hex digits of the content hash>.")
    rows: int = Field(description="Tasks, or episodes with feedback.")
    content_hash: str = Field(description="sha256 of the rows' canonical JSON, in order.")
    through: str | None = Field(
        None, description="Watermark read up to: the last table file, or the feedback seq."
    )
    after: str | None = Field(None, description="The previous run's watermark (None: first).")
    previous_run: str | None = Field(None, description="MLflow run id of the previous run.")
    source_uri: str = Field("", description="Where the rows came from (table folder, server).")

    @property
    def empty(self) -> bool:
        return self.rows == 0

    def reason(self) -> str:
        """Why a run with nothing new stops, in words."""
        since = (
            f"since MLflow run {self.previous_run} (read through {self.after})"
            if self.previous_run
            else "(no earlier run)"
        )
        what = {
            "new_tasks": f"no new tasks in {self.source_uri}",
            "episodes": f"no new feedback on episodes of {self.source_uri}",
            "profile": "no tasks",
        }[self.source]
        return f"{what} {since}: nothing to train on, so nothing trained or registered"

    def tags(self) -> dict[str, str]:
        tags = {TAG_SOURCE: self.source}
        if self.source in WATERMARK_TAGS and self.through is not None:
            tags[WATERMARK_TAGS[self.source]] = self.through
        if self.previous_run:
            tags["data.previous_run"] = self.previous_run
        return tags


def table_folder(config: Any, agent_name: str) -> Path:
    """data=new_tasks reads this table: the configured folder, else <run_dir>/data/<agent>-tasks."""
    if config.data.task_table:
        return Path(config.data.task_table).resolve()
    return Path(config.run_dir).resolve() / "data" / f"{agent_name}-tasks"


def _previous(registry: RegistryConfig, agent: str, source: str) -> tuple[str | None, str | None]:
    found = previous_run_tag(registry, agent, WATERMARK_TAGS[source])
    return (found[0], found[1]) if found else (None, None)


def plan_profile(agent_name: str, tasks: Sequence[dict[str, Any]]) -> DataPlan:
    digest = content_hash(list(tasks))
    name = f"{agent_name}-train"
    return DataPlan(
        source="profile",
        name=name,
        dataset_id=f"{name}@{digest[:12]}",
        rows=len(tasks),
        content_hash=digest,
        source_uri=f"agent profile {agent_name}",
    )


def plan_new_tasks(
    folder: Path, registry: RegistryConfig, agent_name: str
) -> tuple[DataPlan, list[dict[str, Any]]]:
    """The table's tasks added since the previous new_tasks run."""
    previous_run, after = _previous(registry, agent_name, "new_tasks")
    if not folder.exists():
        snapshot_tasks: list[dict[str, Any]] = []
        plan = DataPlan(
            source="new_tasks",
            name=folder.name,
            dataset_id=f"{folder.name}@empty",
            rows=0,
            content_hash=content_hash([]),
            after=after,
            through=after,
            previous_run=previous_run,
            source_uri=str(folder),
        )
        return plan, snapshot_tasks
    part = TaskTable(folder).snapshot(after=after)
    plan = DataPlan(
        source="new_tasks",
        name=part.table,
        dataset_id=part.dataset_id,
        rows=part.rows,
        content_hash=part.content_hash,
        through=part.through or after,
        after=after,
        previous_run=previous_run,
        source_uri=str(folder),
    )
    return plan, list(part.tasks)


async def _fetch_episodes(
    url: str, key_file: str | None, after: int, archive: str | None = None, once: bool = False
) -> tuple[int, list[Feedback], list[Any], list[Any]]:
    """The feedback window (after, watermark] with its episodes' rollouts and spans: from the
    store, and from its archive (`archive`, the folder) for episodes archived since. `once`
    leaves out the episodes that had feedback in an earlier window (trained on before)."""
    reader = ArchiveReader(archive) if archive else None
    try:
        async with store_client(url, key_file) as store:
            through = await store.feedback_watermark()
            feedback = await store.query_feedback(after_seq=after, through_seq=through)
            live = {f.episode_id for f in feedback}
            if reader is not None:
                # An episode in both (an archive killed before its delete, before the store
                # restarted and finished it) is read from the store.
                feedback += [
                    f
                    for f in map(Feedback.model_validate, reader.feedback(through, after))
                    if f.episode_id not in live
                ]
            if once and after > 0:
                seen = await _seen_before(
                    store, reader, sorted({f.episode_id for f in feedback}), after
                )
                feedback = [f for f in feedback if f.episode_id not in seen]
            episodes = sorted({f.episode_id for f in feedback})
            rollouts, spans = [], []
            live_ids = [episode_rollout_id(e) for e in episodes if e in live]
            for i in range(0, len(live_ids), _QUERY_CHUNK):
                chunk = live_ids[i : i + _QUERY_CHUNK]
                rollouts += await store.query_rollouts(rollout_ids=chunk)
                spans += await store.query_spans(chunk)
            archived = [episode_rollout_id(e) for e in episodes if e not in live]
            if reader is not None and archived:
                rollouts += map(Rollout.model_validate, reader.rollouts(archived))
                spans += map(Span.model_validate, reader.spans(archived))
            return through, feedback, rollouts, spans
    finally:
        if reader is not None:
            reader.close()


async def _seen_before(
    store: Any, reader: ArchiveReader | None, episode_ids: list[str], after: int
) -> set[str]:
    """Those of the episodes that had feedback up to seq `after`: an earlier run took them."""
    seen: set[str] = set()
    for i in range(0, len(episode_ids), _QUERY_CHUNK):
        chunk = episode_ids[i : i + _QUERY_CHUNK]
        seen.update(
            f.episode_id for f in await store.query_feedback(episode_ids=chunk, through_seq=after)
        )
    if reader is not None:
        seen.update(r["episode_id"] for r in reader.feedback(after, episode_ids=episode_ids))
    return seen


def plan_episodes(
    url: str,
    key_file: str | None,
    registry: RegistryConfig,
    agent_name: str,
    offline: Any,
    train_agents: Sequence[str] | None,
    archive: str | None = None,
    once: bool = False,
) -> tuple[DataPlan, OfflineBatch | None]:
    """The production episodes whose feedback arrived since the previous episodes run."""
    previous_run, after = _previous(registry, agent_name, "episodes")
    try:
        after_seq = int(after) if after is not None else 0
    except ValueError:
        raise InvalidInput(
            f"MLflow run {previous_run} has a feedback watermark {after!r} that is not a number"
        ) from None
    return plan_episodes_since(
        url, key_file, after_seq, agent_name, offline, train_agents, archive, once, previous_run
    )


def plan_episodes_since(
    url: str,
    key_file: str | None,
    after_seq: int,
    agent_name: str,
    offline: Any,
    train_agents: Sequence[str] | None,
    archive: str | None = None,
    once: bool = False,
    previous_run: str | None = None,
) -> tuple[DataPlan, OfflineBatch | None]:
    """The plan of the episodes whose feedback arrived after seq `after_seq` (0: all)."""
    with _no_cyclic_gc():
        try:
            through, feedback, rollouts, spans = asyncio.run(
                _fetch_episodes(url, key_file, after_seq, archive, once)
            )
        except LightningError as exc:
            raise type(exc)(
                f"cannot read episodes from the production server {url}: {exc}"
            ) from exc
        batch = None
        rows: list[dict[str, Any]] = []
        if feedback:
            batch = episode_batch(
                rollouts, spans, feedback, offline, AdapterConfig(agents=train_agents)
            )
            rows = _episode_rows(batch.transitions, feedback)
    name = f"{agent_name}-episodes"
    digest = content_hash(rows)
    plan = DataPlan(
        source="episodes",
        name=name,
        dataset_id=f"{name}@{digest[:12]}",
        rows=len(rows),
        content_hash=digest,
        through=str(max(through, after_seq)),
        after=str(after_seq) if previous_run is not None or after_seq else None,
        previous_run=previous_run,
        source_uri=url,
    )
    return plan, batch


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """A plan builds hundreds of thousands of objects that all live until it ends: the cyclic
    GC walked them again and again and found nothing to free (6 of 21 s of a plan of 20,000
    episodes, profiled on a loaded machine; 15 s without it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_HASHED = {"step", "prompt_token_ids", "response_token_ids", "response_logprobs", "reward"}


def _episode_rows(
    transitions: Sequence[Transition], feedback: Sequence[Feedback]
) -> list[dict[str, Any]]:
    """What identifies the episodes' data, one row each in episode order: its calls' exact
    tokens, logprobs and rewards (hashed, not copied) and the feedback they came from."""
    digests: dict[str, list[str]] = {}
    for t in transitions:
        digests.setdefault(t.rollout_id, []).append(
            content_hash([t.model_dump(mode="json", include=_HASHED)])
        )
    given: dict[str, list[dict[str, Any]]] = {}
    for f in feedback:
        row = f.model_dump(include={"source", "value", "seq"})
        given.setdefault(episode_rollout_id(f.episode_id), []).append(row)
    return [
        {"episode": e, "transitions": digests[e], "feedback": given.get(e, [])}
        for e in sorted(digests)
    ]


def save_plan(
    root: Path,
    plan: DataPlan,
    tasks: Sequence[dict[str, Any]] | None = None,
    batch: OfflineBatch | None = None,
) -> None:
    """The plan and its data into the run folder: a resumed run reads them back."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    if tasks is not None:
        write_text_atomically(data / TASKS_FILE, json.dumps(list(tasks)))
    if batch is not None:
        write_text_atomically(data / EPISODES_FILE, batch.model_dump_json())
        if batch.feedback:
            # The live reward per policy version, for the analytics views and the report.
            analytics.export_feedback(root, batch.feedback_rows())
    write_text_atomically(data / PLAN_FILE, plan.model_dump_json(indent=1))


def load_plan(root: Path) -> DataPlan | None:
    path = root / "data" / PLAN_FILE
    if not path.exists():
        return None
    return DataPlan.model_validate_json(path.read_text())


def load_plan_tasks(root: str | Path) -> list[dict[str, Any]]:
    return json.loads((Path(root) / "data" / TASKS_FILE).read_text())


def load_plan_batch(root: str | Path) -> OfflineBatch:
    return OfflineBatch.model_validate_json((Path(root) / "data" / EPISODES_FILE).read_text())
