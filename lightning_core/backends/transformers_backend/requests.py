"""What the engine keeps per request (a job) and per completion (a sequence: a batch row)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_core.backends.base import FinishReason, GenerationRequest, StreamDelta
from lightning_core.backends.text import IncrementalText

# PEFT's name for "no adapter" in a mixed batch.
BASE = "__base__"


@dataclass(eq=False)
class Job:
    """One request in the engine, from submission until its last completion is delivered."""

    request: GenerationRequest
    streaming: bool
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue[tuple[int, StreamDelta] | BaseException]
    adapter_id: str = BASE
    # Its grammar's matcher at the start (a grammar.TokenMatcher), compiled before submission
    # off the engine thread; each completion takes a copy. None: free, or compile on admission.
    grammar: Any = None
    stop_ids: frozenset[int] = frozenset()
    unfinished: int = 0
    done: bool = False
    cancelled: bool = False


@dataclass(eq=False)
class Sequence:
    """One completion: a row of the batch."""

    job: Job
    index: int
    generator: torch.Generator
    # Tokens of this sequence in the KV cache; the newest sampled token is not in it yet.
    length: int
    # Its text, for stop strings (None: the request has none).
    text: IncrementalText | None
    # Its grammar's state (a grammar.TokenMatcher), for constrained requests; None: free.
    matcher: Any = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    emitted: int = 0
    finish_reason: FinishReason | None = None

    @property
    def leaving(self) -> bool:
        return self.finish_reason is not None or self.job.cancelled
