"""Calls decoded under a grammar (structured outputs), as the trainer sees them.

Such a call was sampled from the model's distribution with every token the grammar forbade
masked out and the rest renormalised, and the gateway recorded the logprobs of that masked
distribution: it is the behaviour policy. For the importance ratio new / old to compare like
with like, the trainer renormalises its own logprobs over the same allowed sets. It replays
the grammar over the response tokens (the constraint is on the transition) and subtracts
log Z, the log of the probability mass the grammar allowed at each position:

    log pi_masked(a) = logit(a) - logsumexp(allowed logits) = log pi(a) + lse(all) - lse(allowed)

The gradient then includes -grad log Z: probability moves among the tokens the grammar allows,
and no update is spent on tokens it would never let through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_core.backends.base import Constraint
from lightning_core.models import resolve_model


@dataclass
class MaskedSpan:
    """The response positions [start, end) of one row and what the grammar allowed at each."""

    row: int
    start: int
    end: int
    allowed: torch.Tensor  # bool [end - start, vocab]


class GrammarReplay:
    """Recomputes the allowed tokens of each response position from the call's constraint."""

    def __init__(self, model: str | None, vocab_size: int) -> None:
        self._model = model
        self._vocab = vocab_size
        self._compiler: Any = None

    def _compiler_for(self) -> Any:
        if self._compiler is None:
            from transformers import AutoTokenizer

            from lightning_core.backends.grammar import GrammarCompiler

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(self._model))
            self._compiler = GrammarCompiler(tokenizer, self._vocab)
        return self._compiler

    def allowed(self, constraint: Constraint, response_ids: list[int]) -> torch.Tensor:
        """bool [len(response_ids), vocab]: the tokens allowed before each response token."""
        from lightning_core.backends.grammar import allowed_tokens

        matcher = self._compiler_for().matcher(constraint)
        rows = []
        for token in response_ids:
            rows.append(allowed_tokens([matcher], self._vocab, "cpu")[0])
            matcher.accept(token)
        return torch.stack(rows)


def renormalise(logp: torch.Tensor, logits: torch.Tensor, spans: list[MaskedSpan]) -> torch.Tensor:
    """`logp` [rows, width] with the masked spans' positions renormalised over their allowed sets.

    `logits` [rows, width, vocab] are those `logp` came from (log_softmax, then the target's).
    """
    if not spans:
        return logp
    delta = logp.new_zeros(logp.shape)
    for span in spans:
        part = logits[span.row, span.start : span.end]
        allowed = span.allowed.to(part.device)
        delta[span.row, span.start : span.end] = torch.logsumexp(part, -1) - torch.logsumexp(
            part.masked_fill(~allowed, float("-inf")), -1
        )
    return logp + delta
