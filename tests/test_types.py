"""The data model: lifecycle rules and validation."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from lightning_core.errors import IllegalTransition
from lightning_core.types import RolloutRequest, RolloutStatus, Span, Transition

LEGAL = {
    ("queuing", "running"),
    ("queuing", "cancelled"),
    ("running", "succeeded"),
    ("running", "failed"),
    ("running", "cancelled"),
    ("running", "requeuing"),
    ("requeuing", "running"),
    ("requeuing", "cancelled"),
}


@pytest.mark.parametrize("source", list(RolloutStatus))
@pytest.mark.parametrize("target", list(RolloutStatus))
def test_rollout_lifecycle(source, target):
    if (source.value, target.value) in LEGAL:
        source.check_move(target, "r")
    else:
        with pytest.raises(IllegalTransition, match=f"r is {source.value}"):
            source.check_move(target, "r")


def test_finished_statuses():
    assert {s for s in RolloutStatus if s.finished} == {
        RolloutStatus.succeeded,
        RolloutStatus.failed,
        RolloutStatus.cancelled,
    }


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_transition_rewards_must_be_finite(bad):
    base = dict(rollout_id="r", step=0, prompt_token_ids=[1], response_token_ids=[2])
    with pytest.raises(ValidationError):
        Transition(**base, reward=bad)
    with pytest.raises(ValidationError):
        Transition(**base, advantage=bad)
    with pytest.raises(ValidationError):
        Transition(**base, response_logprobs=[bad])


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="extra"):
        RolloutRequest(input=1, groupid="typo")
    with pytest.raises(ValidationError):
        Span(
            rollout_id="r",
            attempt_id="a",
            trace_id="t",
            span_id="s",
            name="n",
            start_time=0,
            kind="sideways",
        )


def test_max_attempts_bounds():
    with pytest.raises(ValidationError):
        RolloutRequest(input=1, max_attempts=0)
