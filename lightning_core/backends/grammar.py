"""Structured outputs: which tokens a grammar allows next, computed by llguidance.

A backend that serves `response_format` json_object or json_schema, or a Lark grammar (vLLM's
`structured_outputs` grammar), keeps one GrammarCompiler per tokenizer, takes a TokenMatcher
per constrained completion, masks the logits of each decoding step with `allowed_tokens` and
feeds every sampled token back through `TokenMatcher.accept`.

Rules, the same for every grammar:
- EOS (the tokenizer's eos_token_id) is allowed exactly when the text so far is complete
  for the grammar; once nothing can follow it is the only token allowed. Sampling EOS ends a
  valid completion, and a complete one must end.
- Whitespace between JSON tokens is bounded (`MAX_WHITESPACE` characters per gap): a model can
  otherwise loop on whitespace until it runs out of tokens.
- Token ids the tokenizer does not have (a model's embedding rows beyond `len(tokenizer)`) and
  special tokens other than EOS are never allowed.
- json_object is any JSON object; json_schema follows the schema as JSON Schema says, so
  properties it does not list are allowed unless it sets `additionalProperties: false`.
- A Lark grammar is llguidance's dialect (the one vLLM's guidance backend reads): `start` is
  the whole completion; its `%ignore` is the grammar's own whitespace rule.

Why llguidance: `benchmarks/grammar_engines.py` ran llguidance 1.9.1, xgrammar 0.2.9 and
outlines-core 0.2.14 on SmolLM2's tokenizer (49152 ids) on 2 CPU cores, with any JSON object
and a 5-field pydantic schema (str, int, enum, list[str], nested object):
- one decoding step (masks + advancing), CPU µs p50: llguidance 18-21 at batch 1 and 78-135 at
  batch 8; xgrammar 34-37 and 208-368; outlines-core 29-93 and 256-279;
- compile to first mask: llguidance 1-2 ms (it builds its lexer lazily), xgrammar 6-12 ms,
  outlines-core 0.12 s for the schema and 7.6-7.9 s for json_object, which it turns into a
  regex and so can only follow to nesting depth 3;
- every walk that ended parsed and validated, with every engine;
- llguidance is one wheel without dependencies; xgrammar requires torch and triton.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import torch

from lightning_core.backends.base import Constraint
from lightning_core.errors import InvalidInput

# Enough for pretty-printed JSON at one level of indentation; beyond it a model is looping.
MAX_WHITESPACE = 4
# Compiled grammars kept per tokenizer: a training run reuses a handful of schemas.
CACHE_SIZE = 64
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Shared by every compiler: a thread pool that fills the rows of a batch in parallel.
_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _parallel() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


# How llguidance words a parser limit it hit (llguidance 1.9: "...; max is 2000").
_PARSER_LIMIT = re.compile(r"max is \d+")


class TokenMatcher:
    """Where one completion stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int, vocab_size: int):
        self._matcher = matcher
        self._eos = eos_token_id
        self._vocab_size = vocab_size
        self._terminated = False

    def copy(self) -> TokenMatcher:
        """A matcher at the same point (~15 µs; it shares the lexer states built so far)."""
        return TokenMatcher(self._matcher.deep_copy(), self._eos, self._vocab_size)

    def error(self) -> InvalidInput | None:
        """Why llguidance gave up on this completion (a limit its grammar hit), if it did."""
        if not self._matcher.is_error():
            return None
        return InvalidInput(
            f"the structured-output grammar failed while generating: {_first_line(self)}; a "
            "right-recursive rule or a choice among many alternatives fills a parser row: "
            "make the rule left-recursive or use fewer alternatives"
        )

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; InvalidInput if llguidance gave up on the grammar here
        (a parser limit), RuntimeError if the grammar does not allow the token."""
        if self._terminated:
            raise RuntimeError(f"token {token_id} after EOS: the constrained completion is over")
        if not self._matcher.consume_token(token_id):
            # llguidance says which: advancing over the token passed one of its parser limits
            # ("Current row has 2101 items; max is 2000": the grammar's doing), or the token was
            # forbidden (a sampling bug, or text that is not in the grammar).
            if _PARSER_LIMIT.search(_first_line(self)):
                raise self.error() or RuntimeError(self._matcher.get_error())
            raise RuntimeError(
                f"token {token_id} is not allowed by the grammar here; sample under "
                f"allowed_tokens() ({self._matcher.get_error()})"
            )
        self._terminated = token_id == self._eos

    @property
    def is_terminated(self) -> bool:
        """True once EOS has been accepted: the completion is over and its text is valid."""
        return self._terminated


def _first_line(matcher: TokenMatcher) -> str:
    # llguidance's verbose errors go on with the parser state and the grammar: not for clients.
    return matcher._matcher.get_error().split("\n", 1)[0][:500]


class GrammarCompiler:
    """Turns constraints into matchers for one tokenizer; compiled grammars are cached (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if tokenizer.eos_token_id is None:
            raise InvalidInput("structured outputs need a tokenizer with an eos_token_id")
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)}")
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
            )
        except ValueError as e:
            raise InvalidInput(f"structured outputs need a fast (Rust) tokenizer: {e}") from e
        self.eos_token_id: int = tokenizer.eos_token_id
        self.vocab_size = vocab_size
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> TokenMatcher:
        """A fresh matcher at the start of the constraint's grammar."""
        key, compile_ = _source(constraint)
        with self._lock:
            template = self._templates.get(key)
            if template is None:
                template = self._compile(compile_(), constraint.kind)
                self._templates[key] = template
                if len(self._templates) > CACHE_SIZE:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(key)
            # A copy takes ~15 µs and shares the lexer states the template's copies have
            # built; a new LLMatcher would parse the grammar again (~1 ms).
            return TokenMatcher(template.deep_copy(), self.eos_token_id, self.vocab_size)

    def _compile(self, grammar: str, kind: str) -> llguidance.LLMatcher:
        """The grammar's matcher, its first mask computed: a grammar llguidance cannot start is
        refused here (400) rather than in the engine, and its lexer is built off the engine
        thread."""
        try:
            template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if not template.is_error():
                probe = template.deep_copy()
                probe.compute_bitmask()
                if probe.is_error():
                    template = probe
        except Exception as e:  # llguidance reports grammar errors by state; anything else too
            raise InvalidInput(f"structured outputs: grammar not usable: {e}") from e
        if template.is_error():
            error = template.get_error().split("\n", 1)[0][:500]
            if kind == "grammar":
                raise InvalidInput(f"structured_outputs: invalid or unsupported grammar: {error}")
            raise InvalidInput(
                f"response_format: invalid or unsupported JSON schema: {error}; "
                "fix the schema or drop the keywords named there"
            )
        return template


def _source(constraint: Constraint) -> tuple[str, Callable[[], str]]:
    """(cache key, a function that builds llguidance's grammar) for a constraint."""
    if constraint.kind == "grammar":
        lark = constraint.grammar
        if not isinstance(lark, str) or not lark.strip():
            raise InvalidInput("a grammar constraint needs its grammar (Lark text)")
        # grammar_from_lark only wraps the text; LLMatcher parses it and reports errors.
        return "lark:" + lark, lambda: llguidance.LLMatcher.grammar_from_lark(lark)
    if constraint.kind == "json_object":
        schema: dict[str, Any] = _ANY_OBJECT
    elif isinstance(constraint.json_schema, dict):
        schema = constraint.json_schema
    else:
        raise InvalidInput("response_format json_schema needs its `schema` (a JSON object)")

    def build() -> str:
        whitespace = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=whitespace)
        except (ValueError, TypeError, RecursionError) as e:
            raise InvalidInput(f"response_format: invalid JSON schema: {e}") from e

    try:
        key = "json:" + json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidInput(f"response_format: invalid JSON schema: {e}") from e
    return key, build


@functools.cache
def _bit_values(device: torch.device) -> torch.Tensor:
    """The 32 single-bit int32 values: `word & values` unpacks a word in one op (half the time
    of shift-and-mask, 75 vs 142 µs for 8 rows of SmolLM2's vocab on CPU)."""
    return torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32).to(device)


def unpack_bitmask(words: torch.Tensor) -> torch.Tensor:
    """int32 bitmask [rows, words] (bit i of word j: token 32 j + i) -> bool [rows, 32 words]."""
    return (words.unsqueeze(-1) & _bit_values(words.device)).bool().view(words.shape[0], -1)


def allowed_tokens(matchers: list[TokenMatcher], vocab_size: int, device: Any) -> torch.Tensor:
    """Bool [len(matchers), vocab_size] on `device`: True where a row's grammar allows the token.

    A terminated row allows EOS alone, so a batch that still carries it never masks a whole row.
    """
    widths = {m._vocab_size for m in matchers}
    if len(widths) > 1:
        raise ValueError(f"matchers of different vocab sizes in one batch: {sorted(widths)}")
    width = widths.pop() if widths else vocab_size
    words = torch.zeros(len(matchers), (width + 31) // 32, dtype=torch.int32)
    live = [(m._matcher, row) for row, m in enumerate(matchers) if not m._terminated]
    if len(live) == 1:
        # One row: computed here, no hand-off to the pool's threads.
        target = words[live[0][1]]
        live[0][0].unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
    elif live:
        _parallel().unsafe_compute_mask_ptr(live, words.data_ptr(), words.shape[1] * 4, len(words))
    for row, m in enumerate(matchers):
        if m._terminated:
            bit = 1 << (m._eos % 32)
            words[row, m._eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
    # Unpacked where the logits are: the bitmask is 32 times smaller to copy.
    mask = unpack_bitmask(words.to(device))
    if mask.shape[1] >= vocab_size:
        return mask[:, :vocab_size]
    return torch.nn.functional.pad(mask, (0, vocab_size - mask.shape[1]))
