"""Which policy version answers a call for `champion` (or `challenger`): the serving routing.

A production server serves whatever the registry's aliases point at; what follows them (the
alias follower, on the pipeline side) tells the gateway so with a new `Routing`, swapped in whole
(`Gateway.apply_routing`). A call reads the routing once, when it picks its adapter, and keeps
that adapter to its end, so a swap never fails or mixes a call in flight: it is answered wholly
by the version it started on, which its span and the answer's header name.

A canary serves `canary_fraction` of the episodes with the challenger instead of the champion.
The split is sticky: an episode's arm is a hash of its id (and of the challenger's name, so that
each canary draws its own slice), the same for every call of the episode on every replica and
after a restart, so each episode's feedback belongs to one version. Calls without an episode id
have no feedback to learn from and go to the champion.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lightning_core.errors import Forbidden, InvalidInput

if TYPE_CHECKING:
    from lightning_core.backends.base import Backend
    from lightning_core.gateway.service import CallContext
    from lightning_core.store.base import SpanRecorder
    from lightning_core.types import PolicyVersion

CHAMPION = "champion"
CHALLENGER = "challenger"
# 8 bytes of sha256: fractions resolved to 2**-64, far finer than any configured share.
_HASH_BYTES = 8


class Routing(BaseModel):
    """The policy versions behind the names `champion` and `challenger`, and the canary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    champion: str | None = Field(
        None, max_length=256, description="Policy version served as `champion`; None: unset."
    )
    challenger: str | None = Field(
        None,
        max_length=256,
        description="Policy version in canary (served as `challenger`, and to a share of the "
        "champion's episodes); None: no canary.",
    )
    canary_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of episodes (sticky per episode id) served by the challenger.",
    )
    status: str = Field(
        "",
        max_length=2000,
        description="What the pipeline last decided about this routing (the live gate's "
        "decision, a rollback's reason), shown by GET /serving/routing.",
    )

    @model_validator(mode="after")
    def _canary_needs_a_challenger(self) -> Routing:
        if self.canary_fraction > 0 and self.challenger is None:
            raise InvalidInput("a canary_fraction above 0 needs a challenger version")
        return self

    def versions(self) -> list[str]:
        """The versions this routing serves."""
        return [v for v in (self.champion, self.challenger) if v is not None]

    def resolve(self, model: str, episode_id: str | None) -> str | None:
        """The version a call asking for `model` in episode `episode_id` gets; None when
        `model` is not a name this routing serves (the gateway's aliases then apply)."""
        if model == CHALLENGER:
            return self.challenger
        if model != CHAMPION or self.champion is None:
            return None
        challenger = self.challenger
        if challenger is None or episode_id is None:
            return self.champion
        return (
            challenger if in_canary(episode_id, challenger, self.canary_fraction) else self.champion
        )


def in_canary(episode_id: str, challenger: str, fraction: float) -> bool:
    """Whether episode `episode_id` is in the canary share `fraction` of `challenger`."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{challenger}\0{episode_id}".encode()).digest()[:_HASH_BYTES]
    return int.from_bytes(digest, "big") < fraction * 2 ** (8 * _HASH_BYTES)


class Routed:
    """The gateway's part that says which policy version answers a call (a mixin of Gateway):
    the routing it serves, replaced whole and never changed in place, so that a call reads it
    once; and the versions published to it."""

    # A class default: frozen, so sharing it is safe until a gateway replaces its own.
    routing: Routing = Routing()
    if TYPE_CHECKING:
        backend: Backend
        store: SpanRecorder | None

        _agent_policies: dict[str, dict[str, str]]

        async def adapter_for(self, model: str, agent: str | None = None) -> str | None: ...

        async def template_fingerprint(self) -> str: ...

    async def route(self, model: str, ctx: CallContext) -> str | None:
        """The adapter that answers a call asking for `model` (None: the base model), picked
        once per call: the routing's version for champion/challenger (the canary's split by
        episode), else adapter_for. Noted on `ctx` for the span and the answer's header."""
        self.check_policy(model, ctx)
        routed = self.routing.resolve(model, ctx.episode_id)
        adapter = await self.adapter_for(routed or model, ctx.agent_name)
        await self.template_fingerprint()  # for the call's span
        ctx.policy_version = adapter or self.backend.base_model
        return adapter

    def check_policy(self, model: str, ctx: CallContext) -> None:
        """Forbidden for a call under a rollout attempt that asks for another model than the
        policy version its rollout is meant for (the runner hands the agent that name). Else an
        agent could sample from any published version, or the base model, inside a rollout of
        another, and its calls would pass provenance: each names the version that answered."""
        if ctx.rollout_id is None or self.store is None:
            return
        meant = self.store.rollout_policy(ctx.rollout_id)
        if meant is not None and model != meant:
            raise Forbidden(
                f"rollout {ctx.rollout_id} is meant for policy version {meant!r}: its calls "
                f"may ask for model {meant!r} only, not {model!r}"
            )

    async def apply_routing(self, routing: Routing) -> Routing:
        """Serve `routing` from now on. Each of its versions must be registered in the store;
        its adapter is loaded (through the adapter rules) before the swap, so that the first
        call routed to it does not wait for the load, and a version that cannot be served is
        refused (InvalidInput, NotFound) with the routing unchanged. Adapters of versions no
        longer routed stay loaded: calls in flight may still be generating with them."""
        if self.store is None:
            raise InvalidInput("this gateway has no store to find policy versions in")
        for version in routing.versions():
            await self.store.get_policy_version(version)  # NotFound: not registered
            await self.adapter_for(version)
        self.routing = routing
        return routing

    def published(self, version: PolicyVersion) -> None:
        """Note a version the store has just registered: its adapter, loaded already, must not
        hide its agents' own versions (adapter_for reads the map before the loaded adapters)."""
        if version.agent_policies:
            self._agent_policies[version.name] = dict(version.agent_policies)
