"""What the store refuses of the writers it cannot trust, beside what it checks of every write.
A part of DuckDBStore, like policies.py; its refusals are counted in `spans_refused`, which
/health/details shows the operator.

Training data is trusted only where the gateway made it. The gateway records each LLM call's
span in the store's own process (`add_spans_nowait`), with the token ids, logprobs, policy
version, adapter hash and template fingerprint it used (gateway/spans.py); a transition is made
from those attributes alone (data/adapter.py). So the attributes only the gateway writes
(`semconv.GATEWAY_ONLY`) are refused (400, naming the attribute) on a span an agent's key writes
over HTTP (`check_agent_spans`): an agent cannot make up a call, its tokens or its logprobs, nor
claim another version answered it. Why refused at the door rather than signed by the gateway
and verified at collection: the door is the one way an agent's spans come in, so checking there
needs no secret to share with the training side, and spans written in process stay as they were.
The admin key may still write them (a fixture, an import of calls recorded elsewhere): it can
write transitions directly anyway, and collection checks every call against the run's record
(data/provenance.py), which refuses a call that lacks the version, hash or fingerprint it expects.

Quotas per rollout attempt, on the spans its writers store through `add_spans` (the HTTP span
routes, with any key, and an in-process exporter): `max_spans_per_attempt` spans and
`max_span_bytes_per_attempt` bytes of their JSON, each refused past it with a 413 that names the
setting; every span of an attempt is read back whole when its rollout is collected. Not counted:
- the gateway's own spans: the gateway bounds them itself (max_calls_per_rollout, prompt and
  generation tokens), and refusing one after its call was answered would lose a call the agent
  already has, midway through a legitimate rollout;
- production episodes: a user's session may rightly run for months (as gateway/limits.py);
- a span sent again while its attempt runs (an exporter's retry): it is stored once.
The counts live in memory from the server's start, one small entry per attempt that wrote spans
(the store holds every attempt in memory already); a restart starts them again, in the writer's
favour and once.

And for the gateway: the policy version a rollout is meant for (`rollout_policy`), which its
calls must ask for (gateway/routing.py).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from lightning_core import semconv
from lightning_core.errors import InvalidInput, PayloadTooLarge
from lightning_core.store.episodes import PRODUCTION_WORKER
from lightning_core.types import Span

if TYPE_CHECKING:
    from lightning_core.store.config import StoreConfig
    from lightning_core.types import Attempt, Rollout

# Why spans were refused: the keys of `spans_refused`.
GATEWAY_ATTRIBUTES = "gateway_attributes"
SPANS_PER_ATTEMPT = "spans_per_attempt"
SPAN_BYTES_PER_ATTEMPT = "span_bytes_per_attempt"


def gateway_only(key: str) -> bool:
    """Whether only the gateway may write the attribute `key` (semconv.GATEWAY_ONLY)."""
    return key in semconv.GATEWAY_ONLY or key.startswith(semconv.GATEWAY_ONLY_PREFIX)


def span_bytes(span: Span) -> int:
    """About what a span takes in the store: its name and its JSON columns (attributes, events,
    resource), where a big span's size lies."""
    size = len(span.name) + len(orjson.dumps(span.attributes)) + len(orjson.dumps(span.resource))
    if span.events:
        size += len(orjson.dumps([e.model_dump() for e in span.events]))
    return size


@dataclass(slots=True)
class _Usage:
    spans: int = 0
    bytes: int = 0


class StoreGuards:
    """Refusals of untrusted spans and the per-attempt quotas (a mixin of DuckDBStore)."""

    if TYPE_CHECKING:
        config: StoreConfig
        _rollouts: dict[str, Rollout]
        _attempts: dict[str, Attempt]
        _seen_spans: dict[str, set[tuple[str, str]]]

        def _stage_spans(self, spans: Sequence[Span]) -> int: ...

    @functools.cached_property
    def spans_refused(self) -> Counter[str]:
        """Requests of spans refused since the server started, by reason (the constants above)."""
        return Counter()

    @functools.cached_property
    def _span_usage(self) -> dict[str, _Usage]:
        return {}

    def rollout_policy(self, rollout_id: str) -> str | None:
        """The policy version rollout `rollout_id` is meant for; None: any (or no such rollout)."""
        rollout = self._rollouts.get(rollout_id)
        return rollout.policy_version if rollout is not None else None

    def check_agent_spans(self, agent_attempt: str | None, spans: Sequence[Span]) -> None:
        """Refuse spans an agent's key writes (of attempt `agent_attempt`; None: the admin
        key, or a keyless server) if any carries an attribute only the gateway writes."""
        if agent_attempt is None:
            return
        for span in spans:
            forged = next((key for key in span.attributes if gateway_only(key)), None)
            if forged is not None:
                self.spans_refused[GATEWAY_ATTRIBUTES] += 1
                raise InvalidInput(
                    f"span {span.span_id}: {forged!r} is an attribute only the gateway writes, "
                    "on the calls it answers; an agent's key may not write it. Call the model "
                    "through the attempt's gateway routes, and it records the call itself"
                )

    def _stage_within_quotas(self, spans: Sequence[Span]) -> int:
        """`_stage_spans`, if no attempt's spans pass its quotas (else PayloadTooLarge, and
        nothing is stored), then counted. No await in between: the check and the count see the
        same usage."""
        added = self._quota_check(spans)
        staged = self._stage_spans(spans)
        for attempt_id, (count, size) in added.items():
            usage = self._span_usage.setdefault(attempt_id, _Usage())
            usage.spans += count
            usage.bytes += size
        return staged

    def _quota_check(self, spans: Sequence[Span]) -> dict[str, tuple[int, int]]:
        """What `spans` add to each attempt's usage (spans, bytes), checked against the quotas."""
        added: dict[str, tuple[int, int]] = {}
        for span in spans:
            attempt = self._attempts.get(span.attempt_id)
            # An unknown attempt is _stage_spans's to refuse; an episode is not counted.
            if attempt is None or attempt.worker_id == PRODUCTION_WORKER:
                continue
            if (span.trace_id, span.span_id) in self._seen_spans.get(span.attempt_id, ()):
                continue
            count, size = added.get(span.attempt_id, (0, 0))
            added[span.attempt_id] = (count + 1, size + span_bytes(span))
        cfg = self.config
        for attempt_id, (count, size) in added.items():
            usage = self._span_usage.get(attempt_id) or _Usage()
            if usage.spans + count > cfg.max_spans_per_attempt:
                self.spans_refused[SPANS_PER_ATTEMPT] += 1
                raise PayloadTooLarge(
                    f"attempt {attempt_id} has stored {usage.spans} spans; {count} more would "
                    f"pass the limit of {cfg.max_spans_per_attempt} spans an attempt may store. "
                    "Record fewer spans, or raise the server's max_spans_per_attempt "
                    "(LIGHTNING_MAX_SPANS_PER_ATTEMPT)"
                )
            if usage.bytes + size > cfg.max_span_bytes_per_attempt:
                self.spans_refused[SPAN_BYTES_PER_ATTEMPT] += 1
                raise PayloadTooLarge(
                    f"attempt {attempt_id} has stored {usage.bytes} bytes of spans; {size} more "
                    f"would pass the limit of {cfg.max_span_bytes_per_attempt} bytes an attempt "
                    "may store. Record smaller spans (shorter attributes), or raise the "
                    "server's max_span_bytes_per_attempt (LIGHTNING_MAX_SPAN_BYTES_PER_ATTEMPT)"
                )
        return added
