"""Prefix merging: one forward pass for the calls of an agent that extend each other.

A multi-turn agent's next call usually sends everything it sent before, the answer it got and
something new (a tool result): its prompt tokens start with the previous call's prompt and
response tokens. Trained as separate transitions, every call computes that shared prefix again.
Merged, such a chain of calls is one row: the last call's prompt + response, in which every
call's response tokens sit where they were generated and keep their own advantage, behaviour
logprobs and temperature. With a causal model the logits at those positions are the same as in
the call's own row, so the update is the unmerged one (tests/test_prefix_merge.py checks it to
1e-5), at the cost of one forward over the longest call instead of one per call.

A chain is made of consecutive calls (in step order) of one agent in one attempt; it breaks
where a prompt does not extend the previous call's prompt + response, which happens when the
chat template rewrites earlier turns (for example one that strips earlier reasoning, or a
tokenisation of the answer text that differs from the generated tokens). The breaks are
counted per agent: a metric of how much merging a template allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from lightning_core.types import Transition

# Counted under this name when a call carries no agent name.
UNNAMED_AGENT = "unnamed"


def extends(previous: Transition, call: Transition) -> bool:
    """Whether `call`'s prompt starts with `previous`'s prompt + response tokens."""
    before = len(previous.prompt_token_ids) + len(previous.response_token_ids)
    return (
        len(call.prompt_token_ids) >= before
        and call.prompt_token_ids[: len(previous.prompt_token_ids)] == previous.prompt_token_ids
        and call.prompt_token_ids[len(previous.prompt_token_ids) : before]
        == previous.response_token_ids
    )


def call_key(t: Transition) -> tuple[Any, ...]:
    """A call's place in the trainer's order, from what it feeds the loss, never its ids.

    Rollout ids are random: a run and its resumption (or a rerun with the same seed) give the
    same calls other ids. Ordered or dealt by id, the same calls would sum in another order and
    end in other last bits, which Adam's later steps grow (a 1.2e-4 gap after three updates).
    Calls equal in all of this are interchangeable: their order changes nothing."""
    return (
        tuple(t.prompt_token_ids),
        tuple(t.response_token_ids),
        t.advantage is None,
        t.advantage or 0.0,
        tuple(t.response_logprobs),
        t.temperature,
        t.finish_reason or "",
        t.step,
    )


def content_key(row: Sequence[Transition]) -> tuple[Any, ...]:
    """call_key of each call of a row (a merged chain), in order."""
    return tuple(call_key(t) for t in row)


def row_length(row: Sequence[Transition]) -> int:
    """Tokens of a row's forward pass: its last call's prompt + response."""
    return len(row[-1].prompt_token_ids) + len(row[-1].response_token_ids)


def length_key(row: Sequence[Transition]) -> tuple[Any, ...]:
    """Rows sorted by this go shortest first (less padding for pack_by_length), ties by content,
    so the same calls in any order make the same micro-batches (whose frozen activations a
    later epoch finds again) and the same update to the last bit."""
    return (row_length(row), content_key(row))


def pack_by_length(rows: Sequence[Sequence[Transition]], budget: int) -> list[list]:
    """Consecutive rows (shortest first) grouped so that each group's padded size (rows x
    longest row) fits the token budget; a row longer than the budget alone (its memory is its
    own length's)."""
    batches: list[list] = []
    current: list = []
    longest = 0
    for row in rows:
        length = row_length(row)
        if current and (len(current) + 1) * max(longest, length) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def _by_agent(transitions: Sequence[Transition]) -> dict[tuple, list[Transition]]:
    calls: dict[tuple, list[Transition]] = {}
    for t in transitions:
        calls.setdefault((t.rollout_id, t.attempt_id, t.agent_name), []).append(t)
    for chain in calls.values():
        chain.sort(key=lambda t: t.step)
    return calls


def merge_rows(transitions: Sequence[Transition]) -> list[list[Transition]]:
    """The transitions as rows: chains of calls that extend each other, in the order of each
    row's first call. A row is as long as its last call, so it fits wherever that call does."""
    rows: list[list[Transition]] = []
    for calls in _by_agent(transitions).values():
        row = [calls[0]]
        for call in calls[1:]:
            if extends(row[-1], call):
                row.append(call)
            else:
                rows.append(row)
                row = [call]
        rows.append(row)
    order = {id(t): i for i, t in enumerate(transitions)}
    return sorted(rows, key=lambda row: order[id(row[0])])


def prefix_breaks(transitions: Sequence[Transition]) -> dict[str, int]:
    """Per agent, how many of its calls do not extend the agent's previous call in the same
    attempt (every agent of the batch is listed, 0 when its prefixes never break)."""
    breaks: dict[str, int] = {}
    for (_, _, agent), calls in _by_agent(transitions).items():
        name = agent or UNNAMED_AGENT
        breaks[name] = breaks.get(name, 0) + sum(not extends(a, b) for a, b in pairwise(calls))
    return breaks
