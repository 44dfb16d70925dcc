"""Builders for test data."""

from __future__ import annotations

import itertools
import time
from typing import Any

from lightning_core import semconv
from lightning_core.types import Claim, Span

_ids = itertools.count(1)


def span(claim: Claim, name: str = "step", **attributes: Any) -> Span:
    n = next(_ids)
    return Span(
        rollout_id=claim.rollout.rollout_id,
        attempt_id=claim.attempt.attempt_id,
        trace_id=f"{n:032x}",
        span_id=f"{n:016x}",
        name=name,
        start_time=time.time(),
        end_time=time.time(),
        attributes=attributes,
    )


def reward_span(claim: Claim, value: float, primary: bool = True) -> Span:
    return span(
        claim,
        semconv.REWARD_SPAN,
        **{semconv.REWARD_VALUE: value, semconv.REWARD_PRIMARY: primary},
    )
