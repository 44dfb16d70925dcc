"""A policy backend on plain transformers + PEFT: continuous batching over a KV cache we manage,
LoRA adapters mixed in one batch, per-request sampling with logprobs.

One engine thread owns the model and loops: take commands (new requests, aborts, adapter loads),
prefill the prompts admitted since the last step in one forward, drop the finished rows from
the batch's KV cache and add the new ones, then run one decode step for every running sequence.
It calls the model's forward directly: HF `generate` rebuilds its cache, masks and logits
processors on every call and cannot add a sequence to a batch that is already decoding.

The cache is right-aligned: every row's tokens end at the same column, so one decode step
writes one column for all rows and the left padding is masked out. Rows of different LoRA
adapters (and of the base model) share a forward through PEFT's `adapter_names=` mixed-batch
path. Works with full-attention decoder models whose attention layers call `cache.update`
(Llama, SmolLM, Qwen2, Mistral without a sliding window); the mask we pass is plain causal.
On CPU the linear layers run on prepacked oneDNN weights (see `_PackedLinear`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import queue
import random
import threading
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field
from torch import nn

from lightning_core.backends.base import Choice, FinishReason, GenerationRequest, StreamDelta
from lightning_core.errors import InvalidInput, NotFound
from lightning_core.models import DEFAULT_MODEL, TINY_MODEL, resolve_model

# PEFT's name for "no adapter" in a mixed batch.
BASE = "__base__"
# Nucleus sampling sorts only the most likely tokens when they hold top_p of the mass (nearly
# always for a trained LM): sorting a whole 49k vocabulary costs about 1 ms a row on CPU.
_NUCLEUS_HEAD = 1024


class TransformersBackendConfig(BaseModel):
    model: str | None = Field(
        None,
        description="Model folder or hub id; None serves SmolLM2-135M-Instruct, 'tiny' the "
        "tiny random test model.",
    )
    served_name: str | None = Field(
        None, description="Name the gateway lists the base model under; default: from `model`."
    )
    device: str | None = Field(
        None, description="torch device ('cpu', 'cuda', 'cuda:1'); None: CUDA when available."
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="None: float32 on CPU (logprobs a trainer reproduces), bfloat16 on CUDA.",
    )
    max_batch_size: int = Field(
        64, ge=1, description="Most sequences decoded together; more requests wait for a row."
    )
    max_prefill_tokens: int = Field(
        4096,
        ge=1,
        description="Most prompt tokens (padding included) prefilled in one forward: bounds the "
        "pause running sequences see when new ones join.",
    )
    cache_chunk: int = Field(
        256, ge=1, description="KV cache columns allocated ahead, so most steps copy nothing."
    )
    threads: int | None = Field(
        None, ge=1, description="torch threads of the engine; None keeps torch's (one per core)."
    )
    prefix_cache_entries: int = Field(
        8,
        ge=0,
        description="Prompt prefixes whose keys and values are kept for reuse (0: none). Agent "
        "prompts share long prefixes (system prompt, tools, examples); prefilling only what "
        "follows them cuts most of the prefill compute.",
    )
    min_prefix_tokens: int = Field(
        16, ge=1, description="Shortest shared prefix worth a separate forward."
    )
    pack_weights: bool = Field(
        True,
        description="On CPU, keep linear weights prepacked for oneDNN: about 2x faster decoding "
        "than MKL's sgemm at small batches, for a second copy of the weights.",
    )


class _PackedLinear(nn.Linear):
    """An nn.Linear computed by oneDNN from a prepacked copy of its weight.

    Decoding multiplies a few rows by every weight matrix; MKL's sgemm is slow at that shape
    (the 49k-row lm_head alone took 12 ms at batch 8, oneDNN packed takes 3 ms). It stays an
    nn.Linear, sharing the original parameters, so tied weights stay tied and PEFT still wraps
    it with LoRA.
    """

    @classmethod
    def wrap(cls, linear: nn.Linear) -> _PackedLinear:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias
        # 8 is the batch size oneDNN tunes the layout for; it measured best from 1 to 32 rows.
        packed._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 8)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def _pack_linears(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, _PackedLinear.wrap(child))


def _can_pack(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = _PackedLinear.wrap(nn.Linear(8, 8, dtype=dtype))
        probe(torch.zeros(2, 8, dtype=dtype))
    except (RuntimeError, AttributeError):
        return False
    return True


class _KVCache:
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

    def append(self, source: _KVCache, rows: list[int], span: int) -> None:
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
        cls, parts: list[tuple[_KVCache, list[int], int]], width: int, capacity: int, rows: int
    ) -> _KVCache:
        """A new cache of the given (cache, rows, span) parts, right-aligned at `width`."""
        cache = cls(rows=0, capacity=capacity, row_capacity=rows, width=width)
        template = parts[0][0]
        cache.keys = [cache._buffer(buffer) for buffer in template.keys]
        cache.values = [cache._buffer(buffer) for buffer in template.values]
        for part, part_rows, span in parts:
            cache.append(part, part_rows, span)
        return cache


def _common_length(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class _PrefixCache:
    """Keys and values of recently prefilled prompt prefixes, by adapter, least recent out.

    An entry's first k columns are the keys and values of its first k tokens whatever follows
    them (attention is causal), so an entry serves any prompt that shares k tokens with it.
    Adapters get a fresh id on every load, so an entry never outlives the weights it was
    computed with.
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[tuple[str | None, tuple[int, ...]], _KVCache] = OrderedDict()

    def lookup(
        self, adapter: str | None, prompt: list[int], limit: int
    ) -> tuple[_KVCache, int] | None:
        """The entry sharing the longest prefix with `prompt` (at most `limit` tokens)."""
        best: tuple[_KVCache, int] | None = None
        best_key = None
        for key, cache in self._items.items():
            if key[0] != adapter:
                continue
            shared = min(_common_length(key[1], prompt), limit)
            if best is None or shared > best[1]:
                best, best_key = (cache, shared), key
        if best_key is not None:
            self._items.move_to_end(best_key)
        return best

    def store(self, adapter: str | None, tokens: list[int], cache: _KVCache) -> None:
        if self.entries <= 0:
            return
        self._items[(adapter, tuple(tokens))] = cache
        self._items.move_to_end((adapter, tuple(tokens)))
        while len(self._items) > self.entries:
            self._items.popitem(last=False)


class _StopStrings:
    """Stop strings found in the incrementally decoded text of one completion.

    `ends[k]` is the length of the text of the first k + 1 tokens. A character whose bytes are
    not all generated yet decodes as U+FFFD; it counts in `ends` (so a cut keeps no partial
    bytes of a stop string) but not in the text searched (it is not that character yet).
    """

    def __init__(self, stops: list[str], decode: Callable[[list[int]], str]) -> None:
        self.stops, self.decode = stops, decode
        self.ends: list[int] = []
        self.text = ""

    def push(self, token_ids: list[int]) -> int | None:
        """Account for the newest token; if a stop string appeared, the tokens to keep."""
        searched = len(self.text)
        text = self.decode(token_ids)
        self.ends.append(len(text))
        self.text = text.rstrip("\ufffd")
        # Only a match ending in the new text is new; earlier ones were found earlier.
        starts = [
            found
            for stop in self.stops
            if (found := self.text.find(stop, max(0, searched - len(stop) + 1))) >= 0
        ]
        if not starts:
            return None
        start = min(starts)
        return next(k for k, end in enumerate(self.ends) if end > start)

    def ready(self, emitted: int) -> int:
        """How many tokens can be streamed: those no stop string can begin in, whatever follows."""
        text, held = self.text, len(self.text)
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = min(held, len(text) - size)
                    break
        while emitted < len(self.ends) and self.ends[emitted] <= held:
            emitted += 1
        return emitted


@dataclass(eq=False)
class _Job:
    """One request in the engine, from submission until its last completion is delivered."""

    request: GenerationRequest
    streaming: bool
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue[tuple[int, StreamDelta] | BaseException]
    adapter_id: str = BASE
    stop_ids: frozenset[int] = frozenset()
    unfinished: int = 0
    done: bool = False
    cancelled: bool = False


@dataclass(eq=False)
class _Sequence:
    """One completion: a row of the batch."""

    job: _Job
    index: int
    generator: torch.Generator
    # Tokens of this sequence in the KV cache; the newest sampled token is not in it yet.
    length: int
    stops: _StopStrings | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    emitted: int = 0
    finish_reason: FinishReason | None = None

    @property
    def leaving(self) -> bool:
        return self.finish_reason is not None or self.job.cancelled


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for outbox, item in items:
        outbox.put_nowait(item)


def _draw(probs: torch.Tensor, top_p: list[float], generators: list[torch.Generator]) -> list[int]:
    """Sample one token id per row of `probs` by inverting its CDF at a uniform draw.

    Each row draws from its own generator, so a seeded request samples the same tokens
    whatever else is in the batch; one batched cumsum + searchsorted replaces a multinomial
    per row (0.8 ms each on a 49k vocabulary). Rows with top_p < 1 first lose every token
    outside their nucleus.
    """
    uniforms = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generators])
    nucleus = [row for row, p in enumerate(top_p) if p < 1.0]
    if nucleus:
        limits = torch.tensor([top_p[row] for row in nucleus], device=probs.device)[:, None]
        part = probs[nucleus]
        head, ids = part.topk(min(_NUCLEUS_HEAD, part.shape[-1]), dim=-1)
        if bool((head.sum(-1, keepdim=True) < limits).any()):
            head, ids = part.sort(dim=-1, descending=True)
        # Keep the most likely tokens until their mass reaches top_p (the one crossing it too).
        keep = (head.cumsum(-1) - head) < limits
        probs[nucleus] = torch.zeros_like(part).scatter_(1, ids, head * keep)
    cdf = probs.cumsum(-1)
    picks = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)
    return picks.clamp_(max=probs.shape[-1] - 1)[:, 0].tolist()


class _Engine:
    """The model, its KV cache and the running batch, driven by one thread."""

    def __init__(self, config: TransformersBackendConfig) -> None:
        self.config = config
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype_name = config.dtype or ("float32" if self.device.type == "cpu" else "bfloat16")
        self.dtype = getattr(torch, dtype_name)
        self.peft: nn.Module | None = None
        # How the LoRA layers are set up (see _select_lora_mode); None: unknown after a change.
        self._lora_mode: str | None = None
        self.adapter_ids: dict[str, str] = {}  # public name -> PEFT adapter name
        self._retired: set[str] = set()  # replaced or unloaded; deleted once unused
        self._users: Counter[str] = Counter()
        self._adapter_numbers = itertools.count()
        self._seeds = random.Random()

        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[_Job] = deque()
        self._prefilling: list[_Job] = []
        self._rows: list[_Sequence] = []
        self._cache: _KVCache | None = None
        self._prefixes = _PrefixCache(config.prefix_cache_entries)
        self.prefix_tokens_reused = 0  # prompt tokens not prefilled thanks to a shared prefix
        self._outbox: list[tuple[_Job, Any]] = []
        self.closed = False
        loaded: Future = Future()
        self._thread = threading.Thread(
            target=self._run, args=(loaded,), name="transformers-engine", daemon=True
        )
        self._thread.start()
        loaded.result()

    def _load(self) -> None:
        """Load (and on first use build) the model and tokenizer, on the engine thread.

        All torch work stays on this one thread: once a second thread has run parallel torch
        ops, libgomp sees more OpenMP threads than cores and stops spinning between parallel
        regions, which made each decode step about 40% slower (29 ms instead of 21 at batch 1).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        path = resolve_model(self.config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # sdpa: the attention that takes our 4D boolean masks as they are.
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, attn_implementation="sdpa"
        )
        self.model: nn.Module = model.to(self.device).eval()
        if self.config.pack_weights and self.device.type == "cpu" and _can_pack(self.dtype):
            _pack_linears(self.model)
        parameters = inspect.signature(type(model).forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.vocab = model.get_input_embeddings().num_embeddings
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.eos_ids = self._eos_ids(model)

    def _eos_ids(self, model: nn.Module) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id}
        generation = getattr(model, "generation_config", None)
        configured = getattr(generation, "eos_token_id", None)
        ids.update(configured if isinstance(configured, list) else [configured])
        return frozenset(i for i in ids if i is not None)

    # -- called from other threads ------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        prompt, params = request.prompt_token_ids, request.params
        if self.context and len(prompt) + params.max_new_tokens > self.context:
            raise InvalidInput(
                f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} = "
                f"{len(prompt) + params.max_new_tokens} exceeds the model's context of "
                f"{self.context} tokens; shorten the prompt or lower max_new_tokens"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise InvalidInput(f"prompt token ids must lie in [0, {self.vocab}) for this model")
        if request.n > self.config.max_batch_size:
            raise InvalidInput(f"n={request.n} exceeds max_batch_size={self.config.max_batch_size}")
        if request.adapter is not None and request.adapter not in self.adapter_ids:
            raise NotFound(self._unknown_adapter(request.adapter))

    def _unknown_adapter(self, name: str) -> str:
        loaded = ", ".join(sorted(self.adapter_ids)) or "none"
        return f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}); load it first"

    def submit(self, job: _Job) -> None:
        self._send("submit", job)

    def abort(self, job: _Job) -> None:
        # A closed engine has failed every job already; nothing is left to abort.
        if not job.done and not self.closed:
            self._inbox.put(("abort", job))

    def call(self, function: Callable[..., Any], *args: Any) -> Future:
        """Run `function` on the engine thread between two steps (for adapter changes)."""
        future: Future = Future()
        self._send("call", (future, function, args))
        return future

    def close(self) -> None:
        if not self.closed:
            self._send("close", None)
        self._thread.join()

    def _send(self, kind: str, payload: Any) -> None:
        if self.closed:
            raise RuntimeError("the transformers backend is closed")
        self._inbox.put((kind, payload))

    # -- the engine thread ----------------------------------------------------------------

    def _run(self, loaded: Future) -> None:
        try:
            self._load()
        except BaseException as exc:
            self.closed = True
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        with torch.inference_mode():
            while not self.closed:
                idle = not self._rows and not self._waiting
                try:
                    self._take_commands(block=idle)
                    if not self.closed:
                        self._step()
                except Exception as exc:  # a failed step fails its requests, never hangs them
                    self._fail_all(exc)
                self._flush()
        closed = RuntimeError("the transformers backend was closed")
        self._fail_all(closed)
        # Whatever was sent after the close command: answer it rather than leave it waiting.
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._outbox.append((payload, closed))
            elif kind == "call":
                payload[0].set_exception(closed)
        self._flush()

    def _take_commands(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self._admit_job(payload)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "call":
                future, function, args = payload
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(function(*args))
                    except Exception as exc:  # handed to the caller
                        future.set_exception(exc)
            elif kind == "close":
                self.closed = True
                return

    def _admit_job(self, job: _Job) -> None:
        request = job.request
        if request.adapter is not None:
            adapter_id = self.adapter_ids.get(request.adapter)
            if adapter_id is None:  # unloaded between validate() and here
                self._outbox.append((job, NotFound(self._unknown_adapter(request.adapter))))
                job.done = True
                return
            job.adapter_id = adapter_id
        self._users[job.adapter_id] += 1
        job.stop_ids = self.eos_ids | frozenset(request.params.stop_token_ids)
        job.unfinished = request.n
        self._waiting.append(job)

    def _abort(self, job: _Job) -> None:
        job.cancelled = True
        with contextlib.suppress(ValueError):
            self._waiting.remove(job)
        self._release(job)

    def _release(self, job: _Job) -> None:
        if not job.done:
            job.done = True
            self._users[job.adapter_id] -= 1
            self._collect_adapters()

    def _fail_all(self, exc: BaseException) -> None:
        jobs = {id(s.job): s.job for s in self._rows}
        jobs.update((id(job), job) for job in [*self._waiting, *self._prefilling])
        for job in jobs.values():
            if not job.done:
                self._outbox.append((job, exc))
                self._release(job)
        self._rows, self._cache, self._prefilling = [], None, []
        self._waiting.clear()

    def _flush(self) -> None:
        by_loop: defaultdict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for job, item in self._outbox:
            by_loop[job.loop].append((job.outbox, item))
        self._outbox.clear()
        for loop, items in by_loop.items():
            # A closed loop has nobody waiting for these any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, items)

    def _step(self) -> None:
        self._prefilling = self._admit()
        joining: list[tuple[_Sequence, int]] = []
        prefilled = None
        if self._prefilling:
            prefilled, joining = self._prefill(self._prefilling)
        cache = self._cache
        full = cache is not None and cache.width == cache.capacity
        if joining or full or any(s.leaving for s in self._rows):
            self._rebuild(joining, prefilled)
        self._prefilling = []
        if self._rows:
            self._decode()

    def _admit(self) -> list[_Job]:
        """Waiting requests that fit the free rows and the prefill budget, first come first."""
        rows = sum(not s.leaving for s in self._rows)
        admitted: list[_Job] = []
        width = 0
        while self._waiting:
            job = self._waiting[0]
            n, length = job.request.n, len(job.request.prompt_token_ids)
            if rows + n > self.config.max_batch_size:
                break
            budget = max(width, length) * (len(admitted) + 1)
            if admitted and budget > self.config.max_prefill_tokens:
                break
            admitted.append(self._waiting.popleft())
            rows, width = rows + n, max(width, length)
        return admitted

    def _prefix(self, jobs: list[_Job]) -> tuple[_KVCache, int] | None:
        """Keys and values of a prefix all `jobs` share (cached or computed now), if worth it."""
        adapters = {job.adapter_id for job in jobs}
        if self.config.prefix_cache_entries <= 0 or len(adapters) != 1:
            return None
        adapter = adapters.pop()
        prompts = [job.request.prompt_token_ids for job in jobs]
        # Every row keeps at least its last token to prefill: its logits give the first sample.
        shared = min(len(p) for p in prompts) - 1
        for prompt in prompts[1:]:
            shared = min(shared, _common_length(prompts[0], prompt))
        minimum = self.config.min_prefix_tokens
        hit = self._prefixes.lookup(adapter, prompts[0], shared)
        if hit is not None and hit[1] >= minimum:
            return hit
        if shared < minimum:
            return None
        device = self.device
        ids = torch.tensor([prompts[0][:shared]], device=device)
        columns = torch.arange(shared, device=device)
        causal = columns[:, None] >= columns[None, :]
        cache = _KVCache(rows=1, capacity=shared)
        self._forward(ids, causal[None, None], columns[None], cache, [adapter])
        cache.advance(shared)
        self._prefixes.store(adapter, prompts[0][:shared], cache)
        return cache, shared

    def _prefill_after(
        self, jobs: list[_Job], prefix: _KVCache, shared: int
    ) -> tuple[torch.Tensor, _KVCache]:
        """Prefill what follows a shared prefix; logits of each row's last token and the cache.

        The suffixes are left-padded after the prefix columns, so each row's suffix already
        ends right-aligned at the width; the prefix is then copied next to the suffix of each
        padded row, so every row ends up contiguous, as the decode mask expects.
        """
        device = self.device
        suffixes = [job.request.prompt_token_ids[shared:] for job in jobs]
        longest = max(map(len, suffixes))
        width = shared + longest
        rows = len(jobs)
        cache = _KVCache(rows=rows, capacity=width, width=shared)
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
        logits = self._forward(input_ids, mask[:, None], positions, cache, [adapter] * rows)
        cache.advance(longest)
        for row, pad in enumerate(pads.tolist()):
            if pad:
                for buffer, source in zip(
                    (*cache.keys, *cache.values), (*prefix.keys, *prefix.values), strict=True
                ):
                    buffer[row, :, pad : pad + shared] = source[0, :, :shared]
        return logits, cache

    def _prefill(self, jobs: list[_Job]) -> tuple[_KVCache, list[tuple[_Sequence, int]]]:
        """One forward over the admitted prompts; sample each completion's first token."""
        prefix = self._prefix(jobs)
        if prefix is not None:
            self.prefix_tokens_reused += prefix[1] * len(jobs)
            logits, cache = self._prefill_after(jobs, *prefix)
            return cache, self._first_tokens(jobs, logits)
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
        cache = _KVCache(rows=len(jobs), capacity=width)
        logits = self._forward(
            input_ids, mask[:, None], positions, cache, [job.adapter_id for job in jobs]
        )
        cache.advance(width)
        return cache, self._first_tokens(jobs, logits)

    def _first_tokens(self, jobs: list[_Job], logits: torch.Tensor) -> list[tuple[_Sequence, int]]:
        """Each completion's sequence, its first token sampled; those that go on decoding."""
        sequences: list[_Sequence] = []
        sources: list[int] = []
        for row, job in enumerate(jobs):
            for index in range(job.request.n):
                sequences.append(self._new_sequence(job, index))
                sources.append(row)
        self._sample(sequences, logits[sources])
        return [(s, row) for s, row in zip(sequences, sources, strict=True) if not s.leaving]

    def _new_sequence(self, job: _Job, index: int) -> _Sequence:
        params = job.request.params
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.manual_seed(self._seeds.getrandbits(63))
        else:
            # Completion i of a seeded request gets its own stream, fixed by (seed, i) alone.
            generator.manual_seed((params.seed + index * 0x9E3779B97F4A7C15) % 2**63)
        stops = None
        if params.stop:
            stops = _StopStrings(
                params.stop, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
            )
        return _Sequence(
            job=job,
            index=index,
            generator=generator,
            length=len(job.request.prompt_token_ids),
            stops=stops,
        )

    def _rebuild(self, joining: list[tuple[_Sequence, int]], prefilled: _KVCache | None) -> None:
        """Drop the rows that left and add the ones joining: in place when they fit, else
        into a new cache, re-aligned and with room to grow."""
        old = self._cache
        kept = [row for row, s in enumerate(self._rows) if not s.leaving]
        joined = [s for s, _ in joining]
        live = [self._rows[row] for row in kept] + joined
        if not live:
            self._rows, self._cache = [], None
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
            self._rows = [self._rows[row] for row in order] + joined
            return
        # Each step writes one column; no row needs more than its remaining new tokens.
        room = max(s.job.request.params.max_new_tokens - len(s.token_ids) for s in live)
        capacity = width + max(1, min(room, self.config.cache_chunk))
        rows = min(self.config.max_batch_size, len(live) + max(4, len(live) // 2))
        parts: list[tuple[_KVCache, list[int], int]] = []
        if kept:
            assert old is not None
            parts.append((old, kept, max(self._rows[row].length for row in kept)))
        if joining:
            assert prefilled is not None
            parts.append((prefilled, join_rows, join_span))
        self._cache = _KVCache.realigned(parts, width, capacity, rows)
        self._rows = live

    def _decode(self) -> None:
        rows, cache = self._rows, self._cache
        assert cache is not None and cache.rows == len(rows)
        device = self.device
        lengths = torch.tensor([s.length for s in rows], device=device)
        input_ids = torch.tensor([[s.token_ids[-1]] for s in rows], device=device)
        columns = torch.arange(cache.width + 1, device=device)
        mask = columns[None, :] >= (cache.width - lengths)[:, None]
        logits = self._forward(
            input_ids,
            mask[:, None, None, :],
            lengths[:, None],
            cache,
            [s.job.adapter_id for s in rows],
        )
        cache.advance(1)
        for s in rows:
            s.length += 1
        self._sample(rows, logits)

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: _KVCache,
        adapter_ids: list[str],
    ) -> torch.Tensor:
        """Logits of the last position of each row (float32)."""
        kwargs = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": positions,
            self._cache_arg: cache,
            "use_cache": True,
            "logits_to_keep": 1,
        }
        if self.peft is None:
            output = self.model(**kwargs)
        elif (names := self._select_lora_mode(adapter_ids)) is None:
            output = self.peft(**kwargs)
        else:
            output = self.peft(adapter_names=names, **kwargs)
        return output.logits[:, -1].float()

    def _select_lora_mode(self, adapter_ids: list[str]) -> list[str] | None:
        """Set the LoRA layers up for this batch; the `adapter_names` to pass, if mixed.

        PEFT's mixed-batch path gathers and scatters each adapter's rows in every LoRA layer
        (it cost SmolLM2 a third of its decode speed at batch 8). A batch on one adapter, the
        common case of an RL policy, takes the plain path with that adapter active, and an
        all-base batch runs with the adapters disabled. Switching walks every module, so it
        happens only when the batch's kind changes.
        """
        assert self.peft is not None
        first = adapter_ids[0]
        mode = first if all(a == first for a in adapter_ids) else "mixed"
        if mode != self._lora_mode:
            if mode == BASE:
                self.peft.base_model.disable_adapter_layers()
            else:
                self.peft.base_model.enable_adapter_layers()
                if mode != "mixed":
                    self.peft.set_adapter(mode, inference_mode=True)
            self._lora_mode = mode
        return adapter_ids if mode == "mixed" else None

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor) -> None:
        params = [s.job.request.params for s in rows]
        # Logprobs are those of the sampling policy: after temperature, before top-p. Greedy
        # rows report them at temperature 1.
        temperatures = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        logprobs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
        tokens = [0] * len(rows)
        greedy = [row for row, p in enumerate(params) if p.temperature == 0]
        sampled = [row for row, p in enumerate(params) if p.temperature > 0]
        if greedy:
            picked = (logits if len(greedy) == len(rows) else logits[greedy]).argmax(dim=-1)
            for row, token in zip(greedy, picked.tolist(), strict=True):
                tokens[row] = token
        if sampled:
            picked = _draw(
                logprobs[sampled].exp(),
                [params[row].top_p for row in sampled],
                [rows[row].generator for row in sampled],
            )
            for row, token in zip(sampled, picked, strict=True):
                tokens[row] = token
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
        chosen_list = chosen[:, 0].tolist()
        most = max(p.top_logprobs for p in params)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if most:
            values, ids = logprobs.topk(most, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for row, s in enumerate(rows):
            wanted = params[row].top_logprobs
            top = (
                list(zip(top_ids[row][:wanted], top_values[row][:wanted], strict=True))
                if wanted
                else None
            )
            self._accept(s, tokens[row], chosen_list[row], top)

    def _accept(
        self, s: _Sequence, token: int, logprob: float, top: list[tuple[int, float]] | None
    ) -> None:
        """Append a sampled token, apply the stopping rules, and emit what is ready."""
        s.token_ids.append(token)
        s.logprobs.append(logprob)
        if top is not None:
            s.top_logprobs.append(top)
        job = s.job
        if token in job.stop_ids:
            s.finish_reason = "stop"
        elif s.stops is not None and (keep := s.stops.push(s.token_ids)) is not None:
            del s.token_ids[keep:], s.logprobs[keep:], s.top_logprobs[keep:]
            s.finish_reason = "stop"
        elif len(s.token_ids) >= job.request.params.max_new_tokens:
            s.finish_reason = "length"
        if job.cancelled:
            return
        if s.finish_reason is None:
            if not job.streaming:
                return
            ready = s.stops.ready(s.emitted) if s.stops is not None else len(s.token_ids)
            if ready == s.emitted:
                return
        else:
            ready = len(s.token_ids)
        wants_top = job.request.params.top_logprobs > 0
        delta = StreamDelta.model_construct(
            token_ids=s.token_ids[s.emitted : ready],
            logprobs=s.logprobs[s.emitted : ready],
            top_logprobs=s.top_logprobs[s.emitted : ready] if wants_top else None,
            finish_reason=s.finish_reason,
        )
        s.emitted = ready
        self._outbox.append((job, (s.index, delta)))
        if s.finish_reason is not None:
            job.unfinished -= 1
            if job.unfinished == 0:
                self._release(job)

    # -- adapters (run on the engine thread through `call`) ---------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        from peft import PeftConfig, PeftModel

        try:
            adapter_config = PeftConfig.from_pretrained(path)
        except Exception as exc:
            raise InvalidInput(
                f"{path} is not a PEFT adapter folder ({exc}); save one with save_pretrained"
            ) from exc
        if str(adapter_config.peft_type) not in ("LORA", "PeftType.LORA"):
            raise InvalidInput(f"{path} holds a {adapter_config.peft_type} adapter, not LoRA")
        # PEFT names must be valid module names, and requests already running on an adapter
        # being replaced keep the weights they started with: each load gets a fresh name.
        adapter_id = f"lora{next(self._adapter_numbers)}"
        # What PeftModel.from_pretrained does, in two steps so that a failed load (missing
        # weights, an adapter of another model) leaves no LoRA layers behind in the model.
        peft = self.peft or PeftModel(self.model, adapter_config, adapter_name=adapter_id)
        try:
            peft.load_adapter(path, adapter_name=adapter_id)
        except Exception as exc:
            if self.peft is None:
                self.model = peft.unload()
            elif adapter_id in peft.peft_config:
                peft.delete_adapter(adapter_id)
            raise InvalidInput(f"cannot load LoRA adapter {name!r} from {path}: {exc}") from exc
        self.peft = peft.eval()
        self._lora_mode = None
        previous = self.adapter_ids.get(name)
        self.adapter_ids[name] = adapter_id
        if previous is not None:
            self._retired.add(previous)
            self._collect_adapters()

    def unload_adapter(self, name: str) -> None:
        adapter_id = self.adapter_ids.pop(name, None)
        if adapter_id is None:
            raise NotFound(self._unknown_adapter(name))
        self._retired.add(adapter_id)
        self._collect_adapters()

    def _collect_adapters(self) -> None:
        for adapter_id in [a for a in self._retired if self._users[a] <= 0]:
            self._retired.discard(adapter_id)
            assert self.peft is not None
            if len(self.peft.peft_config) == 1:
                # The last adapter: unwrap, so batches run the plain model again.
                self.model = self.peft.unload()
                self.peft = None
            else:
                if adapter_id in self.peft.active_adapters:
                    # PEFT would hand "active" on itself, with a warning; _select_lora_mode
                    # sets the active adapter again before the next forward anyway.
                    staying = next(a for a in self.peft.peft_config if a != adapter_id)
                    self.peft.set_adapter(staying, inference_mode=True)
                self.peft.delete_adapter(adapter_id)
            self._lora_mode = None


def _served_name(model: str | None) -> str:
    if model in (None, "", DEFAULT_MODEL, "smollm2"):
        return DEFAULT_MODEL
    if model in ("tiny", TINY_MODEL):
        return TINY_MODEL
    path = Path(model).expanduser()
    return path.name if path.exists() else model


class TransformersBackend:
    """The `Backend` protocol on transformers + PEFT, batching concurrent requests continuously.

    Construct it outside or inside an event loop (loading takes about a second); its async
    methods may be called from any event loop, and the model runs on its own thread.
    """

    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_batch_size: int = 64,
        **options: Any,
    ) -> None:
        self.config = TransformersBackendConfig(
            model=model, device=device, dtype=dtype, max_batch_size=max_batch_size, **options
        )
        self._engine = _Engine(self.config)
        self.base_model: str = self.config.served_name or _served_name(self.config.model)
        self.tokenizer: Any = self._engine.tokenizer

    @classmethod
    def from_config(cls, config: TransformersBackendConfig) -> TransformersBackend:
        return cls(**config.model_dump())

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.dtype

    def adapters(self) -> list[str]:
        return sorted(self._engine.adapter_ids)

    def stats(self) -> dict[str, int]:
        """Sequences decoding now, requests waiting for a row, and prompt tokens served from
        shared prefixes (a snapshot, for metrics)."""
        engine = self._engine
        return {
            "running": sum(not s.leaving for s in list(engine._rows)),
            "waiting": len(engine._waiting),
            "prefix_tokens_reused": engine.prefix_tokens_reused,
        }

    async def generate(self, request: GenerationRequest) -> list[Choice]:
        job = self._submit(request, streaming=False)
        choices: list[Choice | None] = [None] * request.n
        try:
            for _ in range(request.n):
                item = await job.outbox.get()
                if isinstance(item, BaseException):
                    raise item
                index, delta = item
                choices[index] = Choice(
                    token_ids=delta.token_ids,
                    logprobs=delta.logprobs,
                    top_logprobs=delta.top_logprobs,
                    finish_reason=delta.finish_reason,
                )
        finally:
            self._engine.abort(job)
        return [choice for choice in choices if choice is not None]

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        if request.n != 1:
            raise ValueError(
                f"stream() yields one completion, so n must be 1 (got {request.n}); "
                "use generate() for several"
            )
        self._engine.validate(request)
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        job = self._submit(request, streaming=True)
        try:
            while True:
                item = await job.outbox.get()
                if isinstance(item, BaseException):
                    raise item
                _, delta = item
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._engine.abort(job)

    def _submit(self, request: GenerationRequest, streaming: bool) -> _Job:
        self._engine.validate(request)
        job = _Job(
            request=request,
            streaming=streaming,
            loop=asyncio.get_running_loop(),
            outbox=asyncio.Queue(),
        )
        self._engine.submit(job)
        return job

    async def load_adapter(self, name: str, path: str) -> None:
        await asyncio.wrap_future(self._engine.call(self._engine.load_adapter, name, str(path)))

    async def unload_adapter(self, name: str) -> None:
        await asyncio.wrap_future(self._engine.call(self._engine.unload_adapter, name))

    async def close(self) -> None:
        await asyncio.to_thread(self._engine.close)
