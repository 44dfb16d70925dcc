"""The KV cache of the running batch, and the cache of prompt prefixes it reuses."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


class KVCache:
    """Keys and values of a batch, right-aligned at `width`.

    Each layer's buffer is [row_capacity, heads, capacity, dim] and its first `rows` rows are
    live. Row i holds its tokens in the columns just left of `width`; the columns further left
    hold zeros or stale (finite) values of departed rows, which the attention mask hides. Each
    attention layer's `update` writes the forward's new columns at `width` for every row at
    once; the engine then moves `width` on (`advance`). Room for more columns and rows is
    allocated ahead, so a decode step copies nothing (transformers' DynamicCache concatenates:
    a copy of the whole cache per step) and rows leave and join by copying only themselves.
    """

    def __init__(self, rows: int, capacity: int, row_capacity: int = 0, width: int = 0) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows, self.capacity, self.width = rows, capacity, width
        self.row_capacity = max(row_capacity, rows)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):  # allocated by the first forward: shapes from the model
            self.keys.append(self._buffer(key_states))
            self.values.append(self._buffer(value_states))
        end = self.width + key_states.shape[2]
        keys, values = self.keys[layer_idx][: self.rows], self.values[layer_idx][: self.rows]
        keys[:, :, self.width : end] = key_states
        values[:, :, self.width : end] = value_states
        return keys[:, :, :end], values[:, :, :end]

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros((self.row_capacity, like.shape[1], self.capacity, like.shape[3]))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def advance(self, columns: int) -> None:
        self.width += columns

    def keep(self, kept: list[int]) -> list[int]:
        """Keep only the rows `kept` (ascending); return the new row order as old row indices.

        The last live rows move into the holes the others leave, so only they are copied.
        """
        live, staying = len(kept), set(kept)
        holes = [row for row in range(live) if row not in staying]
        movers = [row for row in kept if row >= live]
        if holes:
            target = torch.tensor(holes, device=self.keys[0].device)
            source = torch.tensor(movers, device=self.keys[0].device)
            for buffer in (*self.keys, *self.values):
                buffer[target, :, : self.width] = buffer[source, :, : self.width]
        order = list(range(live))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        self.rows = live
        return order

    def append(self, source: KVCache, rows: list[int], span: int) -> None:
        """Add `rows` of `source` after the live rows: their last `span` columns, ending at
        `width` here as there (span <= width)."""
        target = slice(self.rows, self.rows + len(rows))
        index = torch.tensor(rows, device=self.keys[0].device)
        mine, theirs = (*self.keys, *self.values), (*source.keys, *source.values)
        for buffer, other in zip(mine, theirs, strict=True):
            buffer[target, :, self.width - span : self.width] = other[
                index, :, source.width - span : source.width
            ]
        self.rows += len(rows)

    @classmethod
    def realigned(
        cls, parts: list[tuple[KVCache, list[int], int]], width: int, capacity: int, rows: int
    ) -> KVCache:
        """A new cache of the given (cache, rows, span) parts, right-aligned at `width`."""
        cache = cls(rows=0, capacity=capacity, row_capacity=rows, width=width)
        template = parts[0][0]
        cache.keys = [cache._buffer(buffer) for buffer in template.keys]
        cache.values = [cache._buffer(buffer) for buffer in template.values]
        for part, part_rows, span in parts:
            cache.append(part, part_rows, span)
        return cache


def common_length(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Keys and values of recently prefilled prompt prefixes, by adapter, least recent out.

    An entry's first k columns are the keys and values of its first k tokens whatever follows
    them (attention is causal), so an entry serves any prompt that shares k tokens with it.
    Adapters get a fresh id on every load, so an entry never outlives the weights it was
    computed with.
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[tuple[str | None, tuple[int, ...]], KVCache] = OrderedDict()

    def lookup(
        self, adapter: str | None, prompt: list[int], limit: int
    ) -> tuple[KVCache, int] | None:
        """The entry sharing the longest prefix with `prompt` (at most `limit` tokens)."""
        best: tuple[KVCache, int] | None = None
        best_key = None
        for key, cache in self._items.items():
            if key[0] != adapter:
                continue
            shared = min(common_length(key[1], prompt), limit)
            if best is None or shared > best[1]:
                best, best_key = (cache, shared), key
        if best_key is not None:
            self._items.move_to_end(best_key)
        return best

    def store(self, adapter: str | None, tokens: list[int], cache: KVCache) -> None:
        if self.entries <= 0:
            return
        self._items[(adapter, tuple(tokens))] = cache
        self._items.move_to_end((adapter, tuple(tokens)))
        while len(self._items) > self.entries:
            self._items.popitem(last=False)
