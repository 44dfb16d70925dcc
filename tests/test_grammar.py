"""Structured outputs on the tiny model's real tokenizer: random walks under the grammar's masks
end in JSON that parses and validates, EOS is allowed exactly at completion, and ids the
tokenizer does not have are never allowed."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import jsonschema
import pytest
import torch
from pydantic import BaseModel
from transformers import AutoTokenizer

from lightning_core.backends.base import Constraint
from lightning_core.backends.grammar import (
    MAX_WHITESPACE,
    GrammarCompiler,
    TokenMatcher,
    allowed_tokens,
)
from lightning_core.errors import InvalidInput
from lightning_core.models import resolve_model

# Rows of the model's embedding beyond the tokenizer's ids, as in models padded to a multiple.
PADDING = 64


class Role(StrEnum):
    admin = "admin"
    guest = "guest"


class Address(BaseModel):
    city: str
    zip_code: str


class Person(BaseModel):
    name: str
    age: int
    role: Role
    tags: list[str]
    address: Address


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model("tiny"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer) + PADDING)


def _punctuation_bias(tokenizer: Any) -> torch.Tensor:
    """Logit bonuses that make random walks end within a few hundred tokens: +6 on EOS and on
    single JSON punctuation marks, +3 on the opening ones (at +6 containers nest without end)."""
    marks = {"}": 6.0, "]": 6.0, "{": 3.0, "[": 3.0, '"': 6.0, ",": 6.0, ":": 6.0}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    bias = torch.tensor([marks.get(p, 0.0) for p in pieces] + [0.0] * PADDING)
    bias[tokenizer.eos_token_id] = 6.0
    return bias


def _is_complete(text: str, schema: dict[str, Any]) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and jsonschema.Draft202012Validator(schema).is_valid(value)


def _walk(compiler: GrammarCompiler, tokenizer: Any, constraint: Constraint, seed: int) -> list:
    """Four completions sampled together under the masks, checking EOS and padding at each step."""
    schema = constraint.json_schema or {"type": "object"}
    vocab = compiler.vocab_size
    eos = tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    matchers = [compiler.matcher(constraint) for _ in range(4)]
    logits = torch.randn(4, vocab, generator=generator) + _punctuation_bias(tokenizer)
    tokens: list[list[int]] = [[] for _ in matchers]
    for _ in range(600):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated]
        if not live:
            break
        mask = allowed_tokens([matchers[i] for i in live], vocab, "cpu")
        assert mask.shape == (len(live), vocab) and mask.dtype == torch.bool
        assert not mask[:, len(tokenizer) :].any()
        for row, i in enumerate(live):
            complete = _is_complete(tokenizer.decode(tokens[i]), schema)
            assert bool(mask[row, eos]) == complete, tokenizer.decode(tokens[i])
            if complete:
                assert mask[row].sum() == 1
        # Gumbel-max: a draw from softmax(masked logits), several times faster than multinomial.
        uniform = torch.rand(len(live), vocab, generator=generator).clamp_min(1e-20)
        masked = logits[live].masked_fill(~mask, float("-inf")) - (-uniform.log()).log()
        picks = masked.argmax(-1).tolist()
        for i, token in zip(live, picks, strict=True):
            matchers[i].accept(token)
            tokens[i].append(token)
    ended = [t[:-1] for t, m in zip(tokens, matchers, strict=True) if m.is_terminated]
    assert len(ended) >= 3
    return [json.loads(tokenizer.decode(t)) for t in ended]


def test_json_object_walks_end_in_json_objects(compiler: GrammarCompiler, tokenizer: Any):
    values = _walk(compiler, tokenizer, Constraint(kind="json_object"), seed=0)
    assert all(isinstance(v, dict) for v in values)
    assert sum(len(v) > 0 for v in values) >= 2


def test_json_schema_walks_validate(compiler: GrammarCompiler, tokenizer: Any):
    schema = Person.model_json_schema()
    values = _walk(compiler, tokenizer, Constraint(kind="json_schema", json_schema=schema), seed=1)
    for value in values:
        Person.model_validate(value)


def test_accept_refuses_what_the_grammar_forbids(compiler: GrammarCompiler, tokenizer: Any):
    matcher = compiler.matcher(Constraint(kind="json_object"))
    with pytest.raises(RuntimeError, match="not allowed"):
        matcher.accept(tokenizer.encode("[", add_special_tokens=False)[0])
    matcher = compiler.matcher(Constraint(kind="json_object"))
    with pytest.raises(RuntimeError):
        matcher.accept(tokenizer.eos_token_id)
    matcher = compiler.matcher(Constraint(kind="json_object"))
    with pytest.raises(RuntimeError):
        matcher.accept(len(tokenizer) + 1)


def test_eos_only_at_completion_then_terminated(compiler: GrammarCompiler, tokenizer: Any):
    matcher = compiler.matcher(Constraint(kind="json_object"))
    eos = tokenizer.eos_token_id
    for token in tokenizer.encode('{"a": [1, {"b": null}]}', add_special_tokens=False):
        assert not allowed_tokens([matcher], compiler.vocab_size, "cpu")[0, eos]
        matcher.accept(token)
    mask = allowed_tokens([matcher], compiler.vocab_size, "cpu")[0]
    assert mask.nonzero().view(-1).tolist() == [eos]
    matcher.accept(eos)
    assert matcher.is_terminated
    # A finished row in a batch allows EOS alone, never nothing.
    fresh = compiler.matcher(Constraint(kind="json_object"))
    both = allowed_tokens([matcher, fresh], compiler.vocab_size, "cpu")
    assert both[0].nonzero().view(-1).tolist() == [eos]
    assert both[1].sum() > 1 and not both[1, eos]
    with pytest.raises(RuntimeError, match="after EOS"):
        matcher.accept(eos)


def test_mask_wider_than_the_compiler_pads_with_forbidden(compiler: GrammarCompiler):
    matchers = [compiler.matcher(Constraint(kind="json_object")) for _ in range(2)]
    mask = allowed_tokens(matchers, compiler.vocab_size + 100, "cpu")
    assert mask.shape == (2, compiler.vocab_size + 100)
    assert mask.any() and not mask[:, compiler.vocab_size - PADDING :].any()


def test_cached_grammar_gives_independent_matchers(compiler: GrammarCompiler, tokenizer: Any):
    first: TokenMatcher = compiler.matcher(Constraint(kind="json_object"))
    second = compiler.matcher(Constraint(kind="json_object"))
    first.accept(tokenizer.encode("{", add_special_tokens=False)[0])
    masks = allowed_tokens([first, second], compiler.vocab_size, "cpu")
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.parametrize(
    "schema",
    [
        None,
        {"type": "frobnicate"},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}},
    ],
)
def test_bad_schema_is_invalid_input(compiler: GrammarCompiler, schema: dict | None):
    with pytest.raises(InvalidInput, match="schema"):
        compiler.matcher(Constraint(kind="json_schema", json_schema=schema))


def test_whitespace_is_bounded(compiler: GrammarCompiler, tokenizer: Any):
    matcher = compiler.matcher(Constraint(kind="json_object"))
    matcher.accept(tokenizer.encode("{", add_special_tokens=False)[0])
    space = tokenizer.convert_tokens_to_ids("Ġ")
    for _ in range(MAX_WHITESPACE):
        assert allowed_tokens([matcher], compiler.vocab_size, "cpu")[0, space]
        matcher.accept(space)
    assert not allowed_tokens([matcher], compiler.vocab_size, "cpu")[0, space]
