"""Activations of the frozen layers below the adapter, kept across updates on the same rows.

With `lora.top_layers` the adapter lives in the last layers only; the layers below are the base
model's, untouched by training, so their output on a micro-batch never changes. Offline
retraining runs several epochs (iterations) over the same captured episodes, and every epoch
sends the same micro-batches through them again: 18 of the default model's 30 layers, about 60 %
of each forward pass. This cache keeps the hidden states that enter the first adapted layer, keyed
by the micro-batch's tokens, and a repeat starts the forward pass there.

The replay is exact: the same top layers run on the same hidden states, causal mask and position
embeddings as in the whole pass (a test compares the updates). It is used only where that is
known to hold: a Llama-shaped model (its decoder takes the embeddings as they are; SmolLM2, the
tiny test model), no dropout in the frozen layers, no gradient checkpointing (which needs the
embeddings' gradient hook). Elsewhere the trainer runs the whole pass, as without the cache.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# Decoder stacks whose forward feeds `inputs_embeds` to the first layer unchanged (no scaling),
# so the remaining layers can be run on a cached hidden state passed as the embeddings.
REPLAYABLE = frozenset({"LlamaModel"})


class FrozenActivations:
    """A process-wide LRU of hidden states, bounded in bytes; thread-safe (tasks may run in
    threads). Each trainer counts its own replays (several may share the cache)."""

    def __init__(self, budget_mb: int) -> None:
        self.budget = budget_mb * 2**20
        self.used = 0
        self._entries: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> torch.Tensor | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: tuple[Any, ...], hidden: torch.Tensor) -> None:
        size = hidden.numel() * hidden.element_size()
        if size > self.budget:
            return
        with self._lock:
            if key in self._entries:
                return
            self._evict_to(self.budget - size)
            self._entries[key] = hidden
            self.used += size

    def resize(self, budget_mb: int) -> None:
        """A new budget: the oldest entries leave until the rest fits."""
        with self._lock:
            self.budget = budget_mb * 2**20
            self._evict_to(self.budget)

    def _evict_to(self, limit: int) -> None:
        """Drop the least recently used entries until at most `limit` bytes are held (the
        caller holds the lock)."""
        while self.used > limit:
            _, old = self._entries.popitem(last=False)
            self.used -= old.numel() * old.element_size()


_SHARED: FrozenActivations | None = None
_SHARED_LOCK = threading.Lock()


def shared(budget_mb: int) -> FrozenActivations:
    """The process's cache (kept between the train-offline tasks of one run, which is where
    epochs repeat), at this budget."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = FrozenActivations(budget_mb)
        elif _SHARED.budget != budget_mb * 2**20:
            _SHARED.resize(budget_mb)
        return _SHARED


def decoder(model: Any) -> Any | None:
    """The decoder stack (the module holding `layers`) of a PEFT-wrapped causal LM, when its
    forward is known to replay; else None."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    stack = getattr(causal, "model", None)
    if type(stack).__name__ not in REPLAYABLE or not hasattr(stack, "layers"):
        return None
    return stack


def first_adapted(stack: Any) -> int:
    """The index of the lowest layer with an adapter (LoRA) module; len(layers) if none."""
    for index, layer in enumerate(stack.layers):
        if any("lora_" in name for name, _ in layer.named_modules()):
            return index
    return len(stack.layers)


def frozen_is_deterministic(stack: Any, below: int) -> bool:
    """Whether the layers below `below` compute the same in train and eval mode (no dropout)."""
    if float(getattr(stack.config, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    return not any(
        isinstance(m, torch.nn.Dropout) and m.p > 0
        for layer in stack.layers[:below]
        for m in layer.modules()
    )


def batch_key(prefix: tuple[Any, ...], ids: torch.Tensor, attention: torch.Tensor) -> tuple:
    """The cache key of a micro-batch: what the frozen layers' output depends on (the base
    model, its dtype, how many layers) and the padded tokens with their attention mask."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(tuple(ids.shape)).encode())
    digest.update(ids.detach().cpu().numpy().tobytes())
    digest.update(attention.detach().cpu().numpy().tobytes())
    return (*prefix, digest.hexdigest())


@contextmanager
def capture(stack: Any, index: int) -> Iterator[list[torch.Tensor]]:
    """Collects the hidden state entering layer `index` during a forward pass."""
    seen: list[torch.Tensor] = []

    def hook(_module: Any, args: tuple[Any, ...]) -> None:
        seen.append(args[0].detach())

    handle = stack.layers[index].register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@contextmanager
def from_layer(stack: Any, index: int) -> Iterator[None]:
    """Runs the stack from layer `index` on: the layers below are left out for the duration,
    and the caller passes their cached output as `inputs_embeds`."""
    layers = stack.layers
    stack.layers = layers[index:]
    try:
        yield
    finally:
        stack.layers = layers


@dataclass(frozen=True)
class ReplayPoint:
    """Where a model's forward pass may start from cached activations: its decoder stack, the
    first adapted layer, and the model part of the cache key."""

    stack: Any
    index: int
    model_key: tuple[Any, ...]

    def forward(
        self,
        model: Any,
        cache: FrozenActivations,
        ids: torch.Tensor,
        attention: torch.Tensor,
        keep: int,
    ) -> tuple[Any, bool]:
        """`model`'s forward pass over a micro-batch (its output, and whether it replayed): from
        the first adapted layer on when the frozen layers' output on these rows is cached, else
        whole, keeping that output."""
        key = batch_key(self.model_key, ids, attention)
        hidden = cache.get(key)
        if hidden is not None:
            with from_layer(self.stack, self.index):
                out = model(inputs_embeds=hidden, attention_mask=attention, logits_to_keep=keep)
            return out, True
        with capture(self.stack, self.index) as seen:
            out = model(input_ids=ids, attention_mask=attention, logits_to_keep=keep)
        if seen:
            cache.put(key, seen[0])
        return out, False


def replay_point(
    model: Any, model_name: str, dtype: torch.dtype, gradient_checkpointing: bool
) -> ReplayPoint | None:
    """Where `model` (PEFT-wrapped, base `model_name` in `dtype`) may replay; None where a
    replay would not be exact (see the module's docstring)."""
    stack = decoder(model)
    if stack is None or gradient_checkpointing:
        return None
    index = first_adapted(stack)
    if not 0 < index < len(stack.layers) or not frozen_is_deterministic(stack, index):
        return None
    return ReplayPoint(stack, index, (model_name, str(dtype), index))
