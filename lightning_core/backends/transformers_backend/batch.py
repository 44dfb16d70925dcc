"""The running batch: its rows, their right-aligned KV cache, and the forwards that grow it.

Prompts join by a prefill (after a cached shared prefix where there is one), finished rows
leave, and every step decodes one token for all rows at once. The cache is right-aligned: every
row's tokens end at the same column, so one decode step writes one column for all rows and the
left padding is masked out. The mask we pass is plain causal.
"""

from __future__ import annotations

import torch

from lightning_core.backends.transformers_backend.adapters import Adapters
from lightning_core.backends.transformers_backend.config import TransformersBackendConfig
from lightning_core.backends.transformers_backend.kv_cache import (
    KVCache,
    PrefixCache,
    common_length,
)
from lightning_core.backends.transformers_backend.requests import Job, Sequence
from lightning_core.models import cache_argument


class Batch:
    """Rows decoding together (`rows`, in cache row order) and their KV cache."""

    def __init__(
        self,
        config: TransformersBackendConfig,
        adapters: Adapters,
        device: torch.device,
        pad_id: int,
    ) -> None:
        self.config, self.adapters, self.device, self.pad_id = config, adapters, device, pad_id
        self.rows: list[Sequence] = []
        self.cache: KVCache | None = None
        self.prefixes = PrefixCache(config.prefix_cache_entries)
        self.prefix_tokens_reused = 0  # prompt tokens not prefilled thanks to a shared prefix
        self._cache_arg = cache_argument(adapters.model)

    def clear(self) -> None:
        self.rows, self.cache = [], None

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        adapter_ids: list[str],
    ) -> torch.Tensor:
        """Logits of the last position of each row (float32)."""
        output = self.adapters.forward(
            adapter_ids,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        return output.logits[:, -1].float()

    # -- prefill ----------------------------------------------------------------------------

    def prefill(self, jobs: list[Job]) -> tuple[KVCache, torch.Tensor]:
        """One forward over the admitted prompts: their cache and each last token's logits."""
        prefix = self._prefix(jobs)
        if prefix is not None:
            self.prefix_tokens_reused += prefix[1] * len(jobs)
            return self._prefill_after(jobs, *prefix)
        prompts = [job.request.prompt_token_ids for job in jobs]
        width = max(map(len, prompts))
        device = self.device
        pads = torch.tensor([width - len(p) for p in prompts], device=device)
        input_ids = torch.tensor(
            [[self.pad_id] * (width - len(p)) + p for p in prompts], device=device
        )
        columns = torch.arange(width, device=device)
        positions = (columns[None, :] - pads[:, None]).clamp(min=0)
        causal = columns[:, None] >= columns[None, :]
        mask = causal[None] & (columns[None, None, :] >= pads[:, None, None])
        # Padding queries attend to themselves: a row with every key masked would give NaN,
        # and NaN keys leak through the cache even where the mask hides them (0 * NaN).
        mask |= torch.eye(width, dtype=torch.bool, device=device)
        cache = KVCache(rows=len(jobs), capacity=width)
        logits = self.forward(
            input_ids, mask[:, None], positions, cache, [job.adapter_id for job in jobs]
        )
        cache.advance(width)
        return cache, logits

    def _prefix(self, jobs: list[Job]) -> tuple[KVCache, int] | None:
        """Keys and values of a prefix all `jobs` share (cached or computed now), if worth it."""
        adapters = {job.adapter_id for job in jobs}
        if self.config.prefix_cache_entries <= 0 or len(adapters) != 1:
            return None
        adapter = adapters.pop()
        prompts = [job.request.prompt_token_ids for job in jobs]
        # Every row keeps at least its last token to prefill: its logits give the first sample.
        shared = min(len(p) for p in prompts) - 1
        for prompt in prompts[1:]:
            shared = min(shared, common_length(prompts[0], prompt))
        minimum = self.config.min_prefix_tokens
        hit = self.prefixes.lookup(adapter, prompts[0], shared)
        # A cached prefix shorter than what the rows share leaves every row to prefill the
        # difference; computing the whole shared prefix once costs less when that is more.
        if hit is not None and hit[1] >= minimum and (shared - hit[1]) * len(jobs) <= shared:
            return hit
        if shared < minimum:
            return None
        device = self.device
        ids = torch.tensor([prompts[0][:shared]], device=device)
        columns = torch.arange(shared, device=device)
        causal = columns[:, None] >= columns[None, :]
        cache = KVCache(rows=1, capacity=shared)
        self.forward(ids, causal[None, None], columns[None], cache, [adapter])
        cache.advance(shared)
        self.prefixes.store(adapter, prompts[0][:shared], cache)
        return cache, shared

    def _prefill_after(
        self, jobs: list[Job], prefix: KVCache, shared: int
    ) -> tuple[KVCache, torch.Tensor]:
        """Prefill what follows a shared prefix; the cache and each row's last-token logits.

        The suffixes are left-padded after the prefix columns, so each row's suffix already
        ends right-aligned at the width; the prefix is then copied next to the suffix of each
        padded row, so every row ends up contiguous, as the decode mask expects.
        """
        device = self.device
        suffixes = [job.request.prompt_token_ids[shared:] for job in jobs]
        longest = max(map(len, suffixes))
        width = shared + longest
        rows = len(jobs)
        cache = KVCache(rows=rows, capacity=width, width=shared)
        for mine, theirs in ((cache.keys, prefix.keys), (cache.values, prefix.values)):
            for buffer in theirs:
                grown = buffer.new_zeros((rows, buffer.shape[1], width, buffer.shape[3]))
                grown[:, :, :shared] = buffer[:1, :, :shared]
                mine.append(grown)
        pads = torch.tensor([longest - len(x) for x in suffixes], device=device)
        input_ids = torch.tensor(
            [[self.pad_id] * (longest - len(x)) + x for x in suffixes], device=device
        )
        steps = torch.arange(longest, device=device)
        positions = shared + (steps[None, :] - pads[:, None]).clamp(min=0)
        keys = torch.arange(width, device=device)
        # Query j (column shared + j) sees the prefix and its own suffix up to itself; padding
        # queries see the prefix, so no row is fully masked.
        own = (keys[None, None, :] >= shared + pads[:, None, None]) & (
            keys[None, None, :] <= shared + steps[None, :, None]
        )
        mask = own | (keys < shared)[None, None, :]
        adapter = jobs[0].adapter_id
        logits = self.forward(input_ids, mask[:, None], positions, cache, [adapter] * rows)
        cache.advance(longest)
        for row, pad in enumerate(pads.tolist()):
            if pad:
                for buffer, source in zip(
                    (*cache.keys, *cache.values), (*prefix.keys, *prefix.values), strict=True
                ):
                    buffer[row, :, pad : pad + shared] = source[0, :, :shared]
        return cache, logits

    # -- rows leaving and joining, decoding -------------------------------------------------

    def needs_rebuild(self, joining: bool) -> bool:
        full = self.cache is not None and self.cache.width == self.cache.capacity
        return joining or full or any(s.leaving for s in self.rows)

    def rebuild(self, joining: list[tuple[Sequence, int]], prefilled: KVCache | None) -> None:
        """Drop the rows that left and add the ones joining (each with its row in `prefilled`):
        in place when they fit, else into a new cache, re-aligned and with room to grow."""
        old = self.cache
        kept = [row for row, s in enumerate(self.rows) if not s.leaving]
        joined = [s for s, _ in joining]
        live = [self.rows[row] for row in kept] + joined
        if not live:
            self.rows, self.cache = [], None
            return
        width = max(s.length for s in live)
        join_rows = [row for _, row in joining]
        join_span = max((s.length for s in joined), default=0)
        # In place needs room and nobody longer than the aligned width; a batch mostly made
        # of left padding (its longest rows left) is re-aligned: attention pays for padding.
        if (
            old is not None
            and len(live) <= old.row_capacity
            and width <= old.width < old.capacity
            and old.width - width < max(self.config.cache_chunk, old.width // 2)
        ):
            order = old.keep(kept)
            if joining:
                assert prefilled is not None
                old.append(prefilled, join_rows, join_span)
            self.rows = [self.rows[row] for row in order] + joined
            return
        # Each step writes one column; no row needs more than its remaining new tokens.
        room = max(s.job.request.params.max_new_tokens - len(s.token_ids) for s in live)
        capacity = width + max(1, min(room, self.config.cache_chunk))
        rows = min(self.config.max_batch_size, len(live) + max(4, len(live) // 2))
        parts: list[tuple[KVCache, list[int], int]] = []
        if kept:
            assert old is not None
            parts.append((old, kept, max(self.rows[row].length for row in kept)))
        if joining:
            assert prefilled is not None
            parts.append((prefilled, join_rows, join_span))
        self.cache = KVCache.realigned(parts, width, capacity, rows)
        self.rows = live

    def decode(self) -> torch.Tensor:
        """One forward of every row's newest token; the logits of the next."""
        rows, cache = self.rows, self.cache
        assert cache is not None and cache.rows == len(rows)
        device = self.device
        lengths = torch.tensor([s.length for s in rows], device=device)
        input_ids = torch.tensor([[s.token_ids[-1]] for s in rows], device=device)
        columns = torch.arange(cache.width + 1, device=device)
        mask = columns[None, :] >= (cache.width - lengths)[:, None]
        logits = self.forward(
            input_ids,
            mask[:, None, None, :],
            lengths[:, None],
            cache,
            [s.job.adapter_id for s in rows],
        )
        cache.advance(1)
        for s in rows:
            s.length += 1
        return logits
