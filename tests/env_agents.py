"""An agent of tests/test_env_service.py: one SQL episode on the environment service.

Each session writes a scratch table of the same name, puts its own marker in it and reads it
back: on a shared database every session but one would fail to create the table and all would
see each other's markers. Between writing and reading, the agent waits for the test's gate (a
file), so that the test can kill the service while every session is open (each agent says it
arrived there with a file of its own). Its reward is the submission's (1 for the gold query)
when it saw exactly its own marker, else 0.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from lightning_core.envs.client import EnvClient


async def sql_episode(task: dict[str, Any], llm: Any) -> float:
    client = EnvClient(os.environ["TEST_SQL_ENV_URL"])
    gate = Path(os.environ["TEST_SQL_ENV_GATE"])
    async with client.session({"db": task["db"], "gold_sql": task["gold_sql"]}) as env:
        created = await env.step({"sql": "CREATE TABLE scratch (owner TEXT)"})
        if "error" in created.observation:
            return 0.0
        await env.step({"sql": f"INSERT INTO scratch VALUES ('{task['id']}')"})
        (gate.parent / f"arrived-{env.session_id}").touch()
        while not gate.exists():
            await asyncio.sleep(0.05)
        seen = await env.step({"sql": "SELECT owner FROM scratch"})
        if seen.observation.get("rows") != [[task["id"]]]:
            return 0.0
        submitted = await env.step({"submit": task["gold_sql"]})
        assert submitted.done
        return float(submitted.reward or 0.0)
