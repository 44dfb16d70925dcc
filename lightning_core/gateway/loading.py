"""How the gateway finds the adapter that answers a call, and what it records about it.

A request's `model` names the base model, a loaded LoRA adapter, or a policy version registered
in the store, whose adapter is then loaded on first use (or when it is published,
`load_version`). Each adapter's files are hashed as they are loaded, and the tokenizer that
renders prompts is fingerprinted once (security/provenance.py): every call's span carries
both, so a run can tell which bytes and which template produced the tokens it trains on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from lightning_core import semconv
from lightning_core.errors import InvalidInput, NotFound
from lightning_core.security import provenance
from lightning_core.security.adapter_folder import check_adapter
from lightning_core.types import PolicyVersion

if TYPE_CHECKING:
    from lightning_core.backends.base import Backend
    from lightning_core.gateway.service import GatewayConfig
    from lightning_core.store.base import SpanRecorder


class AdapterLoading:
    """The gateway's part that loads policy versions' adapters (a mixin of Gateway)."""

    if TYPE_CHECKING:
        backend: Backend
        store: SpanRecorder | None
        config: GatewayConfig
        tokenizer: Any
        _loading: asyncio.Lock
        _agent_policies: dict[str, dict[str, str]]

    # Provenance of what answers: each loaded adapter's content hash (a dict of each
    # gateway's own, made in Gateway.__init__), and the tokenizer's fingerprint once computed
    # (a class default of None until then).
    _adapter_hashes: dict[str, str]
    _template_fingerprint: str | None = None

    def adapter_hash(self, adapter: str | None) -> str | None:
        """The content hash of the loaded adapter `adapter` (None: the base model, or an
        adapter loaded other than through this class)."""
        return self._adapter_hashes.get(adapter) if adapter is not None else None

    async def adapter_for(self, model: str, agent: str | None = None) -> str | None:
        """The adapter serving `model` (None: the base model) to a call of `agent`, loading a
        registered one. When `model` has a policy of `agent`'s own, that policy's adapter; its
        own agent map is not followed (one level), so maps cannot form cycles. An alias
        (`model_aliases`) is looked up first, once."""
        model = self.config.model_aliases.get(model, model)
        if model == self.backend.base_model:
            return None
        own = self._agent_policies.get(model, {}).get(agent) if agent is not None else None
        if own is not None:
            return await self.adapter_for(own)
        if model in self.backend.adapters():
            return model
        version = None
        if self.store is not None:
            try:
                version = await self.store.get_policy_version(model)
            except NotFound:
                version = None
        if version is None:
            served = [self.backend.base_model, *self.backend.adapters()]
            raise NotFound(
                f"model {model!r} is not served here; served: {', '.join(served)} "
                "(or any policy version registered in the store)"
            )
        if version.agent_policies:
            self._agent_policies[model] = dict(version.agent_policies)
            if agent in version.agent_policies:
                return await self.adapter_for(version.agent_policies[agent])
        if version.adapter_path is None:
            return None
        folder = str(await asyncio.to_thread(check_adapter, version.adapter_path, self.config))
        async with self._loading:
            if model not in self.backend.adapters():
                await self._load_adapter(version, folder)
        return model

    async def load_version(self, version: PolicyVersion) -> bool:
        """Load a new policy version's adapter (on every replica) before the store registers
        it, so that no call sees the version unloaded anywhere; True if this loaded it. One the
        store has already is left as it is (the store refuses it again). Its folder must pass
        the adapter rules (adapter_folder.py) before any backend, or the Hub, sees it."""
        if version.adapter_path is None:
            return False
        folder = str(await asyncio.to_thread(check_adapter, version.adapter_path, self.config))
        if self.store is not None:
            with contextlib.suppress(NotFound):
                await self.store.get_policy_version(version.name)
                return False
        async with self._loading:
            await self._load_adapter(version, folder)
        return True

    async def _load_adapter(self, version: PolicyVersion, folder: str) -> None:
        """Load `version`'s adapter from its checked `folder`, hashing the files first: the
        hash every span of the version carries is that of the bytes loaded (security/provenance.py).
        A hash its publisher declared (metadata `adapter_hash`) must match: a folder
        rewritten since training is refused (InvalidInput) rather than served under its name."""
        digest = await asyncio.to_thread(provenance.adapter_hash, folder)
        declared = version.metadata.get(semconv.ADAPTER_HASH_METADATA)
        if declared is not None and declared != digest:
            raise InvalidInput(
                f"the adapter folder of policy version {version.name!r} no longer holds what "
                f"its publisher declared (content hash {digest[:12]}, declared "
                f"{str(declared)[:12]}): it was rewritten after it was published"
            )
        await self.backend.load_adapter(version.name, folder)
        self._adapter_hashes[version.name] = digest

    @property
    def known_template_fingerprint(self) -> str | None:
        """The fingerprint, once `template_fingerprint` has computed it."""
        return self._template_fingerprint

    async def template_fingerprint(self) -> str:
        """The fingerprint of the tokenizer and chat template calls are rendered with,
        computed once, on a worker thread (it reads the whole vocabulary)."""
        if self._template_fingerprint is None:
            self._template_fingerprint = await asyncio.to_thread(
                provenance.template_fingerprint, self.tokenizer
            )
        return self._template_fingerprint
