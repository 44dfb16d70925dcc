"""Spans to transitions: ordering, rewards on the right step, agent filter, AIR."""

from __future__ import annotations

import pytest

from lightning_core import semconv
from lightning_core.algo.rewards import AIRRule
from lightning_core.data.adapter import AdapterConfig, spans_to_transitions
from lightning_core.types import Rollout, Span

_clock = iter(range(1, 10_000))


def _span(name: str, **attributes) -> Span:
    t = float(next(_clock))
    return Span(
        rollout_id="ro-1",
        attempt_id="at-1",
        trace_id="a" * 32,
        span_id=f"{int(t):016x}",
        name=name,
        start_time=t,
        end_time=t,
        attributes=attributes,
        status_code="error" if attributes.pop("_error", False) else "unset",
    )


def call(prompt: list[int], *responses: list[int], agent: str | None = None) -> Span:
    attrs = {semconv.PROMPT_TOKEN_IDS: prompt, semconv.RESPONSE_COUNT: len(responses)}
    attrs[semconv.POLICY_VERSION] = "v1"
    for i, ids in enumerate(responses):
        attrs[semconv.RESPONSE.format(i=i, key="token_ids")] = ids
        attrs[semconv.RESPONSE.format(i=i, key="logprobs")] = [-0.5] * len(ids)
    if agent:
        attrs[semconv.AGENT_NAME] = agent
    return _span("chat m", **attrs)


def reward(value: float, primary: bool = True) -> Span:
    return _span(
        semconv.REWARD_SPAN, **{semconv.REWARD_VALUE: value, semconv.REWARD_PRIMARY: primary}
    )


def tool(success: bool) -> Span:
    return _span(semconv.TOOL_SPAN, **{semconv.TOOL_SUCCESS: success, semconv.TOOL_NAME: "calc"})


def test_one_transition_per_call_with_final_reward_on_the_last():
    spans = [call([1, 2], [3]), call([1, 2, 3, 4], [5, 6]), reward(1.0)]
    ts = spans_to_transitions(spans)
    assert [(t.step, t.prompt_token_ids, t.response_token_ids) for t in ts] == [
        (0, [1, 2], [3]),
        (1, [1, 2, 3, 4], [5, 6]),
    ]
    assert [t.reward for t in ts] == [0.0, 1.0]
    assert ts[1].response_logprobs == [-0.5, -0.5] and ts[0].policy_version == "v1"


def test_a_transition_carries_its_finish_reason():
    cut = call([1, 2], [3, 4])
    cut.attributes[semconv.RESPONSE.format(i=0, key="finish_reason")] = "length"
    [t] = spans_to_transitions([cut])
    assert t.finish_reason == "length"
    [t] = spans_to_transitions([call([1], [2])])
    assert t.finish_reason is None  # a span from before it was recorded


def test_intermediate_rewards_go_to_the_step_they_follow():
    spans = [
        reward(0.25, primary=False),  # before any call: the first step gets it
        call([1], [2]),
        reward(0.5, primary=False),
        call([1], [3]),
        reward(0.1),  # an earlier primary reward is intermediate: only the last one is final
        call([1], [4]),
        reward(2.0),
    ]
    assert [t.reward for t in spans_to_transitions(spans)] == [0.75, 0.1, 2.0]


def test_spans_are_ordered_by_end_time_not_arrival():
    late, early = call([1], [9]), call([1], [8])
    late.sequence_id, early.sequence_id = 1, 2
    early.end_time = late.end_time - 0.5
    assert [t.response_token_ids for t in spans_to_transitions([late, early])] == [[8], [9]]


def test_n_choices_are_separate_transitions():
    ts = spans_to_transitions([call([1], [2], [3], [4]), reward(1.0)])
    assert [t.response_token_ids for t in ts] == [[2], [3], [4]]
    assert [t.step for t in ts] == [0, 1, 2]


def test_rollout_final_reward_is_used_without_reward_spans():
    rollout = Rollout(rollout_id="ro-1", input=None, enqueued_at=0.0, episode_return=0.5)
    assert [t.reward for t in spans_to_transitions([call([1], [2])], rollout)] == [0.5]
    assert spans_to_transitions([reward(1.0)]) == []


def test_agent_filter_keeps_chosen_agents_and_moves_their_rewards():
    spans = [
        call([1], [2], agent="writer"),
        call([1], [3], agent="checker"),
        reward(0.5, primary=False),  # follows the checker: goes to the writer's call
        call([1], [4], agent="rewriter"),
        reward(1.0),
    ]
    config = AdapterConfig(agents=["writer", "rewriter"])
    ts = spans_to_transitions(spans, config=config)
    assert [(t.agent_name, t.reward) for t in ts] == [("writer", 0.5), ("rewriter", 1.0)]
    assert len(spans_to_transitions(spans)) == 3


@pytest.mark.parametrize(
    ("outcome", "expected"), [("success", [0.1, 1.0]), ("failure", [-0.2, 1.0])]
)
def test_air_rules_turn_tool_outcomes_into_rewards(outcome, expected):
    rules = [
        AIRRule(name="lightning.tool", outcome="success", reward=0.1),
        AIRRule(name="lightning.*", outcome="failure", reward=-0.2),
    ]
    spans = [call([1], [2]), tool(outcome == "success"), call([1], [3]), reward(1.0)]
    ts = spans_to_transitions(spans, config=AdapterConfig(air=rules))
    assert [round(t.reward, 6) for t in ts] == expected


def test_air_failure_from_span_status_and_attribute_match():
    failed = _span("tool.search", _error=True, query="x")
    rules = [AIRRule(name="tool.*", outcome="failure", attributes={"query": "x"}, reward=-1.0)]
    ts = spans_to_transitions([call([1], [2]), failed], config=AdapterConfig(air=rules))
    assert ts[0].reward == -1.0
    other = [AIRRule(name="tool.*", outcome="failure", attributes={"query": "y"}, reward=-1.0)]
    assert (
        spans_to_transitions([call([1], [2]), failed], config=AdapterConfig(air=other))[0].reward
        == 0.0
    )
