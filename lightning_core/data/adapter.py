"""A rollout's spans to its transitions: one per LLM call (per choice), in the order they ended.

Rewards follow the timeline: an intermediate reward (an emitted non-final reward, or what AIR
rules give a tool span) is added to the transition of the last LLM call before it; the episode's
final reward (the last primary reward span, else the rollout's episode_return) is added to the
last transition. So a transition's reward is what its action earned right after it, and the
episode return is the sum over the transitions, which credit assignment spreads back.

With an agent filter (train only some agents of a multi-agent system), the calls of other agents
are left out, and rewards that follow them go to the last kept call before them.
"""

from __future__ import annotations

import orjson
from pydantic import BaseModel, Field

from lightning_core import semconv
from lightning_core.algo.rewards import AIRRule, air_reward
from lightning_core.backends.base import Constraint
from lightning_core.types import Rollout, Span, Transition


class AdapterConfig(BaseModel):
    """How spans become transitions."""

    agents: list[str] | None = Field(
        None,
        description="Train only the LLM calls of these agent names (X-Lightning-Agent); "
        "None trains every call. Calls without a name count as agent None.",
    )
    air: list[AIRRule] = Field(
        default_factory=list, description="Automatic intermediate reward rules."
    )


def timeline_order(span: Span) -> tuple[float, int]:
    # An LLM call's span ends when its answer is sent, which is before anything the agent does
    # with the answer; ties (same clock tick) fall back to arrival order.
    return (span.end_time or span.start_time, span.sequence_id or 0)


def _is_call(span: Span) -> bool:
    # A judge's own calls (lightning_core/judge) may be recorded beside the agent's, under
    # the same rollout: they are never trained on.
    return (
        semconv.PROMPT_TOKEN_IDS in span.attributes
        and span.attributes.get(semconv.AGENT_NAME) != semconv.JUDGE_AGENT
    )


def _constraint(attributes: dict) -> Constraint | None:
    kind = attributes.get(semconv.CONSTRAINT)
    if kind is None:
        return None
    schema = attributes.get(semconv.CONSTRAINT_SCHEMA)
    return Constraint(
        kind=kind,
        json_schema=orjson.loads(schema) if schema else None,
        grammar=attributes.get(semconv.CONSTRAINT_GRAMMAR),
    )


def _call_transitions(span: Span) -> list[Transition]:
    a = span.attributes
    count = int(a.get(semconv.RESPONSE_COUNT, 0))
    constraint = _constraint(a)
    return [
        Transition(
            rollout_id=span.rollout_id,
            attempt_id=span.attempt_id,
            step=0,  # numbered once the calls are chosen
            agent_name=a.get(semconv.AGENT_NAME),
            prompt_token_ids=list(a[semconv.PROMPT_TOKEN_IDS]),
            response_token_ids=list(a[semconv.RESPONSE.format(i=i, key="token_ids")]),
            response_logprobs=list(a.get(semconv.RESPONSE.format(i=i, key="logprobs"), [])),
            policy_version=a.get(semconv.POLICY_VERSION),
            output_constraint=constraint,
            temperature=a.get("gen_ai.request.temperature", 1.0),
            top_p=a.get("gen_ai.request.top_p", 1.0),
            finish_reason=a.get(semconv.RESPONSE.format(i=i, key="finish_reason")),
            adapter_hash=a.get(semconv.ADAPTER_HASH),
            template_fingerprint=a.get(semconv.TEMPLATE_FINGERPRINT),
        )
        for i in range(count)
    ]


def spans_to_transitions(
    spans: list[Span],
    rollout: Rollout | None = None,
    config: AdapterConfig | None = None,
    final: float | None = None,
) -> list[Transition]:
    """The transitions of one attempt's spans (pass the spans of a single attempt). `final`,
    when given, is the episode's final reward in place of the one the spans hold (a judge's
    combined with it)."""
    config = config or AdapterConfig()
    timeline = sorted(spans, key=timeline_order)
    rewards = [s for s in timeline if s.name == semconv.REWARD_SPAN]
    last = next(
        (s for s in reversed(rewards) if s.attributes.get(semconv.REWARD_PRIMARY, True)), None
    )

    transitions: list[Transition] = []
    pending = 0.0  # rewards seen before any kept call: they go to the first one
    for span in timeline:
        if _is_call(span):
            if config.agents is not None and span.attributes.get(semconv.AGENT_NAME) not in (
                config.agents
            ):
                continue
            new = _call_transitions(span)
            if new and pending:
                new[0].reward += pending
                pending = 0.0
            transitions.extend(new)
            continue
        if span is last:
            continue
        if span.name == semconv.REWARD_SPAN:
            gained = float(span.attributes.get(semconv.REWARD_VALUE, 0.0))
        else:
            gained = air_reward(span, config.air)
        if not gained:
            continue
        if transitions:
            transitions[-1].reward += gained
        else:
            pending += gained

    final_value = (
        final
        if final is not None
        else float(last.attributes[semconv.REWARD_VALUE])
        if last is not None
        else (rollout.episode_return if rollout is not None else None)
    )
    if transitions:
        transitions[-1].reward += (final_value or 0.0) + pending
    for step, transition in enumerate(transitions):
        transition.step = step
    return transitions
