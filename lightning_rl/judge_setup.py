"""The run's judge as tasks open it (docs/judge.md): `JudgeSetup` holds plain names and paths
(the judge's config, rubric, endpoint, the path of the server's key file or the name of the
variable that holds the endpoint's key), never a key, since task parameters are stored and
shown in the UI.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from pydantic import BaseModel

from lightning_core.data.collect import Judged
from lightning_core.errors import InvalidInput
from lightning_core.judge.cache import JudgeCache, Spend
from lightning_core.judge.client import Judge
from lightning_core.judge.config import SERVER, JudgeConfig
from lightning_core.judge.groups import judge_rollouts
from lightning_core.store.client import HttpStoreClient
from lightning_rl.policy_server import read_key

CACHE_FILE = "judge.sqlite"


class JudgeSetup(BaseModel):
    """What a task needs to open the run's judge."""

    config: JudgeConfig
    rubric: str
    task_fields: list[str]
    model: str
    base_url: str
    key_file: str | None = None  # the run's server key file, for endpoint=server
    cache_path: str


def api_key(setup: JudgeSetup) -> str | None:
    if setup.config.endpoint == SERVER:
        return read_key(setup.key_file)
    name = setup.config.api_key_env
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise InvalidInput(f"judge.api_key_env names {name}, which is not set in this process")
    return key


@asynccontextmanager
async def open_judge(setup: JudgeSetup) -> AsyncIterator[Judge]:
    cache = JudgeCache(Path(setup.cache_path))
    judge = Judge(setup.config, setup.rubric, setup.model, setup.base_url, api_key(setup), cache)
    try:
        yield judge
    finally:
        await judge.close()
        cache.close()


def spend(setup: JudgeSetup) -> Spend:
    """What the run's judge has cost so far."""
    cache = JudgeCache(Path(setup.cache_path))
    try:
        return cache.spent()
    finally:
        cache.close()


async def judge_collected(
    store: HttpStoreClient, setup: JudgeSetup, rollout_ids: Sequence[str]
) -> Judged:
    """The judge's say on finished rollouts; its spans are stored on them."""
    rollouts = await store.query_rollouts(rollout_ids=list(rollout_ids))
    spans = await store.query_spans(list(rollout_ids), "latest")
    async with open_judge(setup) as judge:
        judged, recorded = await judge_rollouts(judge, setup.task_fields, rollouts, spans)
    if recorded:
        await store.add_spans(recorded)
    return judged
