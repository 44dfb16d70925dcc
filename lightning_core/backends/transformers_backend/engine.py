"""The engine thread: it owns the model and loops over commands, admissions and decode steps.

Each step takes commands (new requests, aborts, adapter loads), prefills the prompts admitted
since the last step in one forward, drops the finished rows from the batch and adds the new
ones, then decodes one token for every running sequence. It calls the model's forward directly:
HF `generate` rebuilds its cache, masks and logits processors on every call and cannot add a
sequence to a batch that is already decoding. Sampled tokens go through the stopping rules of
`base.py`; what a request may see is handed back to its event loop in one batch per step.

One request's failure is its own: an error in one sequence (its grammar matcher, its sampling,
its stopping rules and detokenizing) fails that sequence's request, and a failed prefill fails
the requests in it (the running batch's cache is untouched); the batch goes on. Only a decode
forward failing (the model itself) fails every request, after which the batch starts empty and
the engine serves the next requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import random
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from lightning_core.backends.base import Constraint, GenerationRequest, StreamDelta
from lightning_core.backends.text import IncrementalText
from lightning_core.backends.transformers_backend.adapters import Adapters
from lightning_core.backends.transformers_backend.batch import Batch
from lightning_core.backends.transformers_backend.config import TransformersBackendConfig
from lightning_core.backends.transformers_backend.kv_cache import common_length
from lightning_core.backends.transformers_backend.packed_linear import can_pack, pack_linears
from lightning_core.backends.transformers_backend.requests import Job, Sequence
from lightning_core.backends.transformers_backend.sampling import Draws, sample
from lightning_core.errors import InvalidInput, NotFound
from lightning_core.models import resolve_model

# Waiting requests one admission looks past for ones sharing the first one's prefix.
_MAX_PASSED = 256


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for outbox, item in items:
        outbox.put_nowait(item)


class Engine:
    """The model, its adapters and the running batch, driven by one thread."""

    def __init__(self, config: TransformersBackendConfig) -> None:
        self.config = config
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype_name = config.dtype or ("float32" if self.device.type == "cpu" else "bfloat16")
        self.dtype = getattr(torch, dtype_name)
        self._seeds = random.Random()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[Job] = deque()
        self._prefilling: list[Job] = []
        self._outbox: list[tuple[Job, Any]] = []
        # Built on the first constrained request (it imports the grammar library); compiling
        # happens on request threads (validation) and the engine thread (matchers): one lock.
        self._grammar: Any = None
        self._grammar_lock = threading.Lock()
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
        from transformers.utils import logging as hf_logging

        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        path = resolve_model(self.config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # A local folder loads in about a second; its "Loading weights" bar in a benchmark's or
        # a server's output read as a stage of its own (the trainer quiets it too).
        hf_logging.disable_progress_bar()
        # sdpa: the attention that takes our 4D boolean masks as they are.
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, attn_implementation="sdpa"
        )
        model = model.to(self.device).eval()
        if self.config.pack_weights and self.device.type == "cpu" and can_pack(self.dtype):
            pack_linears(model)
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.vocab = model.get_input_embeddings().num_embeddings
        self.eos_ids = self._eos_ids(model)
        self.adapters = Adapters(model)
        self.batch = Batch(
            self.config, self.adapters, self.device, self.tokenizer.pad_token_id or 0
        )

    def _eos_ids(self, model: nn.Module) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id}
        generation = getattr(model, "generation_config", None)
        configured = getattr(generation, "eos_token_id", None)
        ids.update(configured if isinstance(configured, list) else [configured])
        return frozenset(i for i in ids if i is not None)

    # -- called from other threads ------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """InvalidInput/NotFound for a request this engine cannot serve (cheap checks; its
        grammar is checked by `grammar`)."""
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
        if request.adapter is not None and request.adapter not in self.adapters.ids:
            raise NotFound(self.adapters.unknown(request.adapter))

    def grammar(self, request: GenerationRequest) -> Any:
        """The request's grammar matcher (None: unconstrained), compiled on the caller's thread:
        milliseconds to a second, for a worker thread. InvalidInput for a grammar it cannot use."""
        constraint = request.params.constraint
        return None if constraint is None else self.matcher(constraint)

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh grammar matcher for `constraint` (InvalidInput for a schema it cannot use)."""
        with self._grammar_lock:
            if self._grammar is None:
                from lightning_core.backends.grammar import GrammarCompiler

                self._grammar = GrammarCompiler(self.tokenizer, self.vocab)
            return self._grammar.matcher(constraint)

    def stats(self) -> dict[str, int]:
        return {
            "running": sum(not s.leaving for s in list(self.batch.rows)),
            "waiting": len(self._waiting),
            "prefix_tokens_reused": self.batch.prefix_tokens_reused,
        }

    def submit(self, job: Job) -> None:
        self._send("submit", job)

    def abort(self, job: Job) -> None:
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
                idle = not self.batch.rows and not self._waiting
                try:
                    self._take_commands(block=idle)
                    if not self.closed:
                        self._step()
                except Exception as exc:  # the model failed: fail every request, never hang one
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

    def _admit_job(self, job: Job) -> None:
        request = job.request
        if request.adapter is not None:
            adapter_id = self.adapters.ids.get(request.adapter)
            if adapter_id is None:  # unloaded between validate() and here
                self._outbox.append((job, NotFound(self.adapters.unknown(request.adapter))))
                job.done = True
                return
            job.adapter_id = adapter_id
        self.adapters.hold(job.adapter_id)
        job.stop_ids = self.eos_ids | frozenset(request.params.stop_token_ids)
        job.unfinished = request.n
        self._waiting.append(job)

    def _abort(self, job: Job) -> None:
        job.cancelled = True
        with contextlib.suppress(ValueError):
            self._waiting.remove(job)
        self._release(job)

    def _release(self, job: Job) -> None:
        if not job.done:
            job.done = True
            self.adapters.release(job.adapter_id)

    def _fail(self, job: Job, exc: BaseException) -> None:
        """Fail one request with `exc`: its sequences leave the batch at the next rebuild."""
        if not job.done:
            self._outbox.append((job, exc))
        self._abort(job)

    def _fail_all(self, exc: BaseException) -> None:
        jobs = {id(s.job): s.job for s in self.batch.rows}
        jobs.update((id(job), job) for job in [*self._waiting, *self._prefilling])
        for job in jobs.values():
            if not job.done:
                self._outbox.append((job, exc))
                self._release(job)
        self.batch.clear()
        self._prefilling = []
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
        batch = self.batch
        self._prefilling = self._admit()
        joining: list[tuple[Sequence, int]] = []
        prefilled = None
        if self._prefilling:
            try:
                prefilled, logits = batch.prefill(self._prefilling)
            except Exception as exc:  # a forward of these prompts alone (a new cache): theirs
                for job in self._prefilling:
                    self._fail(job, exc)
            else:
                joining = self._first_tokens(self._prefilling, logits)
        if batch.needs_rebuild(bool(joining)):
            batch.rebuild(joining, prefilled)
        self._prefilling = []
        if batch.rows:
            self._sample(batch.rows, batch.decode())

    def _admit(self) -> list[Job]:
        """Waiting requests that fit the free rows and the prefill budget, first come first.

        With the prefix cache on, one step admits only requests that share a long prefix with
        the first waiting one (same adapter, at least half its prompt): a prefill reuses a
        prefix only when every prompt in it shares that prefix, and a multi-agent system sends
        prompts of several roles at once (a writer's and a checker's share only the chat
        template's first tokens). The others keep their places for the next steps.
        """
        rows = sum(not s.leaving for s in self.batch.rows)
        admitted: list[Job] = []
        passed: list[Job] = []
        width = 0
        grouping = self.config.prefix_cache_entries > 0
        while self._waiting and len(passed) < _MAX_PASSED:
            job = self._waiting[0]
            n, length = job.request.n, len(job.request.prompt_token_ids)
            if rows + n > self.config.max_batch_size:
                break
            if grouping and admitted and not self._shares_prefix(admitted[0], job):
                passed.append(self._waiting.popleft())
                continue
            budget = max(width, length) * (len(admitted) + 1)
            if admitted and budget > self.config.max_prefill_tokens:
                break
            admitted.append(self._waiting.popleft())
            rows, width = rows + n, max(width, length)
        self._waiting.extendleft(reversed(passed))
        return admitted

    def _shares_prefix(self, first: Job, job: Job) -> bool:
        if job.adapter_id != first.adapter_id:
            return False
        head = first.request.prompt_token_ids
        needed = max(self.config.min_prefix_tokens, len(head) // 2)
        return common_length(head, job.request.prompt_token_ids) >= needed

    def _first_tokens(self, jobs: list[Job], logits: torch.Tensor) -> list[tuple[Sequence, int]]:
        """Each completion's sequence, its first token sampled; those that go on decoding."""
        sequences: list[Sequence] = []
        sources: list[int] = []
        for row, job in enumerate(jobs):
            try:
                mine = [self._new_sequence(job, index) for index in range(job.request.n)]
            except Exception as exc:  # its grammar could not be copied or compiled
                self._fail(job, exc)
                continue
            sequences += mine
            sources += [row] * len(mine)
        if not sequences:
            return []
        self._sample(sequences, logits[sources])
        return [(s, row) for s, row in zip(sequences, sources, strict=True) if not s.leaving]

    def _new_sequence(self, job: Job, index: int) -> Sequence:
        params = job.request.params
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.manual_seed(self._seeds.getrandbits(63))
        else:
            # Completion i of a seeded request gets its own stream, fixed by (seed, i) alone.
            generator.manual_seed((params.seed + index * 0x9E3779B97F4A7C15) % 2**63)
        matcher = None
        if job.grammar is not None:  # compiled by grammar(), off this thread
            matcher = job.grammar.copy()
        elif params.constraint is not None:
            matcher = self.matcher(params.constraint)
        return Sequence(
            job=job,
            index=index,
            generator=generator,
            length=len(job.request.prompt_token_ids),
            text=IncrementalText(self.tokenizer, stops=params.stop) if params.stop else None,
            matcher=matcher,
        )

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """Sample each row's next token and account for it. `logits` is the engine's to change.

        A row whose grammar, sampling or stopping rules raise fails its own request; the other
        rows go on. When the batched masking or sampling raises, each row is sampled alone to
        find whose it was (a seeded row then draws once more from its generator: only a batch
        that had a failing row loses reproducibility).
        """
        try:
            draws = self._draw(rows, logits)
        except Exception as exc:
            if len(rows) == 1:
                self._fail(rows[0].job, exc)
                return
            for row, s in enumerate(rows):
                if not s.leaving:
                    self._sample([s], logits[row : row + 1])
            return
        for row, s in enumerate(rows):
            if s.job.cancelled:  # failed by its grammar above, or by its other sequence
                continue
            try:
                self._accept(s, draws.tokens[row], draws.logprobs[row], draws.top[row])
            except Exception as exc:
                self._fail(s.job, exc)

    def _draw(self, rows: list[Sequence], logits: torch.Tensor) -> Draws:
        constrained = [row for row, s in enumerate(rows) if s.matcher is not None]
        if constrained:
            # Forbidden tokens leave the distribution before temperature and log_softmax: the
            # logprobs reported are those of what was sampled from (see base.Constraint).
            from lightning_core.backends.grammar import allowed_tokens

            matchers = [rows[row].matcher for row in constrained]
            allowed = allowed_tokens(matchers, logits.shape[-1], logits.device)
            for matcher, row in zip(matchers, constrained, strict=True):
                if (error := matcher.error()) is not None:  # a limit hit inside llguidance
                    self._fail(rows[row].job, error)
            logits[constrained] = logits[constrained].masked_fill(~allowed, float("-inf"))
        return sample(logits, [s.job.request.params for s in rows], [s.generator for s in rows])

    def _accept(
        self, s: Sequence, token: int, logprob: float, top: list[tuple[int, float]] | None
    ) -> None:
        """Append a sampled token, apply the stopping rules, and emit what is ready."""
        s.token_ids.append(token)
        s.logprobs.append(logprob)
        if top is not None:
            s.top_logprobs.append(top)
        job = s.job
        if token in job.stop_ids:
            s.finish_reason = "stop"
        elif s.text is not None and (keep := s.text.push([token])) is not None:
            del s.token_ids[keep:], s.logprobs[keep:], s.top_logprobs[keep:]
            s.finish_reason = "stop"
        elif len(s.token_ids) >= job.request.params.max_new_tokens:
            s.finish_reason = "length"
        elif s.matcher is not None:
            s.matcher.accept(token)
            if s.matcher.is_terminated:  # a grammar that ends without an eos token
                s.finish_reason = "stop"
        if job.cancelled:
            return
        if s.finish_reason is None:
            if not job.streaming:
                return
            ready = max(s.emitted, s.text.ready_tokens()) if s.text else len(s.token_ids)
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
            stop_sequence=s.text.stop if s.text is not None and s.finish_reason else None,
        )
        s.emitted = ready
        self._outbox.append((job, (s.index, delta)))
        if s.finish_reason is not None:
            job.unfinished -= 1
            if job.unfinished == 0:
                self._release(job)
