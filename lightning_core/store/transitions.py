"""Transitions in the store: the unified training data, one row per LLM call, written by
collection and read back by the trainer. A part of DuckDBStore, like policies.py: rows are logged
durably before an add answers, and read back once each, latest attempt first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson

from lightning_core.errors import InvalidInput
from lightning_core.store import schema
from lightning_core.store.pages import PagedReads, read_cursor
from lightning_core.types import Rollout, Transition


class TransitionStore(PagedReads):
    """Transitions, on the durable log of the DuckDBStore it is part of."""

    if TYPE_CHECKING:

        def _start_background(self) -> None: ...
        def _log(self, table: schema.Table, row: tuple[Any, ...]) -> None: ...
        def _rollout(self, rollout_id: str) -> Rollout: ...

    async def add_transitions(self, transitions: Sequence[Transition]) -> int:
        self._start_background()
        for t in transitions:
            self._rollout(t.rollout_id)
            if t.response_logprobs and len(t.response_logprobs) != len(t.response_token_ids):
                raise InvalidInput(
                    f"transition {t.rollout_id}#{t.step}: {len(t.response_logprobs)} logprobs "
                    f"for {len(t.response_token_ids)} response tokens"
                )
        for t in transitions:
            self._log(schema.TRANSITIONS, schema.transition_row(t))
        await self._sync()
        return len(transitions)

    async def query_transitions(
        self,
        rollout_ids: Sequence[str] | None = None,
        policy_version: str | None = None,
    ) -> list[Transition]:
        rows, _ = await self.query_transitions_json(rollout_ids, policy_version)
        return [Transition.model_validate(row) for row in orjson.loads(rows)]

    async def query_transitions_json(
        self,
        rollout_ids: Sequence[str] | None = None,
        policy_version: str | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> tuple[bytes, str | None]:
        """Transitions as a JSON array: the first `limit` (all: None) after cursor `after`, in
        (rollout, step, attempt) order, and the next page's cursor (None when none is left)."""
        sql, params, where = "SELECT * FROM transitions", [], []
        if rollout_ids is not None:
            where.append("rollout_id IN ?")
            params.append(list(rollout_ids) or [""])
        if policy_version is not None:
            where.append("policy_version = ?")
            params.append(policy_version)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql = f"SELECT * FROM ({sql} {schema.TRANSITIONS_LATEST})"
        if after is not None:
            rollout_id, step, attempt_id = read_cursor(after, 3, "transitions")
            sql += f" WHERE {schema.TRANSITIONS_KEY} > (?, ?, ?)"
            # The key reads a missing attempt id as "" (schema.TRANSITIONS_KEY).
            params += [rollout_id, step, attempt_id or ""]
        sql += f" ORDER BY {schema.TRANSITIONS_KEY}"
        return await self._page(sql, params, limit, ("rollout_id", "step", "attempt_id"))
