"""Policy versions in the store: the servable policies the gateway resolves a `model` name to.

A name is registered once and never changes (a new adapter is a new version), which lets the
gateway keep what it looked up. A part of DuckDBStore, like episodes.py: it keeps its versions
in memory, loaded at start, and logs each new one durably before answering.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_core.errors import Conflict, NotFound
from lightning_core.store import schema
from lightning_core.types import PolicyVersion


class PolicyVersionStore:
    """Policy versions, on the durable log of the DuckDBStore it is part of."""

    if TYPE_CHECKING:

        def _start_background(self) -> None: ...
        def _log(self, table: schema.Table, row: tuple[Any, ...]) -> None: ...
        async def _sync(self, upto: int | None = None) -> None: ...

    def _load_policies(self, state: dict[str, Any]) -> None:
        self._policies: dict[str, PolicyVersion] = {}
        for row in state["policy_versions"]:
            version = PolicyVersion.model_validate(row)
            self._policies[version.name] = version

    async def add_policy_version(self, version: PolicyVersion) -> PolicyVersion:
        self._start_background()
        if version.name in self._policies:
            raise Conflict(f"policy version {version.name!r} exists already; pick a new name")
        self._policies[version.name] = version.model_copy(deep=True)
        self._log(schema.POLICY_VERSIONS, schema.policy_version_row(version))
        await self._sync()
        return version

    async def get_policy_version(self, name: str) -> PolicyVersion:
        try:
            version = self._policies[name]
        except KeyError:
            raise NotFound(f"no policy version {name!r}") from None
        await self._sync()
        return version.model_copy(deep=True)

    async def list_policy_versions(self) -> list[PolicyVersion]:
        await self._sync()
        return sorted(
            (v.model_copy(deep=True) for v in self._policies.values()), key=lambda v: v.created_at
        )
