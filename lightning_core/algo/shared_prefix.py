"""Shared-prefix forward passes: the rows of a micro-batch that begin with the same tokens
compute them once.

The G rollouts of a group answer the same task, so their first calls send the same prompt
(system prompt, tools, worked examples, the question, and whatever the agent fetched before its
first call), and rows of different tasks of one agent still share its system prompt. Trained
row by row, a micro-batch of a group's G rows runs that prompt through the model G times: for
the RAG and SQL agents, whose prompts are hundreds of tokens and whose answers tens, most of a
training step. Here the rows of a micro-batch are split where they stop agreeing: one forward
over the shared prefix keeps its keys and values, and every row's remaining tokens run as a
batch that attends to them (the cache repeated per row, as generation's prefix cache does). The
logits at every position are those of the row's own whole pass, and the gradient flows back
through the cached keys and values into the prefix's single forward, summed over the rows as the
separate passes' gradients would be: the update is the same (tests/test_shared_prefix.py checks
it to 1e-5), at the cost of one prefix instead of G.

Rows are ordered by their first call's prompt (equal prompts together, then by length) so that
a micro-batch holds rows that share, and a micro-batch's memory is counted as what it computes:
the prefix once plus each row's padded rest. The split stays before every row's first target
position (the last prompt token, whose logits predict the first response token), so every
logit the loss reads comes from the batched rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_core.algo.prefix import content_key, row_length
from lightning_core.backends.transformers_backend.kv_cache import common_length
from lightning_core.models import cache_argument
from lightning_core.types import Transition

# A shorter shared prefix is computed with each row: a second forward call costs more than it
# saves there.
MIN_SHARED_TOKENS = 32

Row = Sequence[Transition]


def order_key(row: Row) -> tuple[Any, ...]:
    """Rows sorted by this put equal first prompts (a group's rows) next to each other and,
    across tasks, prompts that begin alike; shorter rows first within a prompt (less padding);
    ties by content (prefix.content_key), so the same transitions make the same micro-batches
    whatever their rollout ids."""
    return (tuple(row[0].prompt_token_ids), row_length(row), content_key(row))


def shared_length(rows: Sequence[Row]) -> int:
    """How many leading tokens the rows' forward computes once: the longest prefix every row's
    first prompt starts with, kept before the shortest prompt's last token (the first target
    position); 0 for a single row or a prefix shorter than MIN_SHARED_TOKENS."""
    if len(rows) < 2:
        return 0
    first = rows[0][0].prompt_token_ids
    shared = min(len(row[0].prompt_token_ids) for row in rows) - 1
    for row in rows[1:]:
        shared = min(shared, common_length(first, row[0].prompt_token_ids))
    return shared if shared >= MIN_SHARED_TOKENS else 0


def forward_cost(rows: Sequence[Row], shared: int | None = None) -> int:
    """Padded tokens a micro-batch's forward computes: the shared prefix (shared_length, unless
    given) once, each row's rest padded to the longest."""
    shared = shared_length(rows) if shared is None else shared
    return shared + len(rows) * (max(row_length(row) for row in rows) - shared)


def forward_tokens(rows: Sequence[Row], shared: int) -> int:
    """Tokens a micro-batch's forward computes, padding aside: the rows' tokens less the
    `shared` prefix's repeats (what train/forward_tokens_saved_frac counts)."""
    return sum(map(row_length, rows)) - shared * (len(rows) - 1)


def pack(rows: Sequence[Row], budget: int) -> list[list[Row]]:
    """Consecutive rows (in order_key order) grouped so that each group's forward_cost fits the
    token budget (a row over the budget alone is a group of its own), and a row joins the
    group before it only if that computes no more tokens than starting a group of its own:
    joining shortens the prefix the group shares to what the row shares with it, so a group's
    rows stop at the next task rather than share only the system prompt with it."""
    batches: list[list[Row]] = []
    current: list[Row] = []
    # shared_length(current) once it holds two rows; with one, the test below reads it x 0.
    before = 0
    for row in rows:
        if current:
            joined = [*current, row]
            after = shared_length(joined)
            # Tokens saved together (after x n) against apart (before x (n - 1)).
            if forward_cost(joined, after) > budget or after * len(current) < before * (
                len(current) - 1
            ):
                batches.append(current)
                current, after = [], 0
            before = after
        current.append(row)
    if current:
        batches.append(current)
    return batches


def forward_shared(
    model: Any, ids: torch.Tensor, attention: torch.Tensor, keep: int, shared: int
) -> Any:
    """The model's output for right-padded rows `ids` whose first `shared` tokens are equal,
    with the last `keep` positions' logits: the prefix's forward once, then the rest of every
    row attending to its keys and values. Requires shared <= ids.shape[1] - keep."""
    length = ids.shape[1]
    if shared > length - keep:
        raise ValueError(f"a shared prefix of {shared} reaches the {keep} kept positions")
    prefix = model(
        input_ids=ids[:1, :shared],
        attention_mask=attention[:1, :shared],
        use_cache=True,
        logits_to_keep=1,
    )
    name = cache_argument(model)  # in and out
    cache = getattr(prefix, name)
    # Repeated rows, not views: the rest's forward appends its own keys and values per row. The
    # repeat is differentiable, so every row's gradient reaches the prefix's one forward.
    cache.batch_repeat_interleave(ids.shape[0])
    positions = torch.arange(shared, length, device=ids.device).expand(ids.shape[0], -1)
    return model(
        input_ids=ids[:, shared:],
        attention_mask=attention,
        **{name: cache},
        position_ids=positions,
        logits_to_keep=keep,
    )
