"""Prefix merging (prefix.py): calls whose prompts extend each other share a forward pass and
train exactly as they would apart; a chat template that rewrites earlier turns breaks the chain."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import get_args

import pytest
import torch
from transformers import AutoTokenizer

from lightning_core.algo.config import Aggregation, TrainerConfig
from lightning_core.algo.prefix import extends, merge_rows, prefix_breaks
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.gateway.chat import encode, render_chat
from lightning_core.models import tiny_model_dir
from lightning_core.types import Transition
from tests.models import TOOL_CALL_TEXT, TOOL_QUESTION, TOOLS

# Two chat templates of the same format; the second, like Qwen3's, keeps only what follows
# </think> in the assistant turns before the last user message: earlier reasoning is stripped.
KEEPS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STRIPS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>')[-1].lstrip('\n') }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ANSWERS = ["<think>2 and 3 make 5</think>The sum is 5.", "<think>5 times 4</think>It is 20."]


def chat_episode(template: str, rollout: str = "r0", advantage: float = 1.0) -> list[Transition]:
    """An agent's two calls: ask, answer, a follow-up, answer; prompts rendered by `template`
    and token ids as the gateway records them (the response ends with the end-of-turn token)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    calls = []
    for step, answer in enumerate(ANSWERS):
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        response = [*encode(tokenizer, answer), end]
        calls.append(
            Transition(
                rollout_id=rollout,
                step=step,
                agent_name="solver",
                prompt_token_ids=encode(tokenizer, text),
                response_token_ids=response,
                response_logprobs=[-8.0 + 0.1 * i for i in range(len(response))],
                advantage=advantage * (1 + step),
            )
        )
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And times 4?"},
        ]
    return calls


def test_a_template_that_keeps_earlier_turns_merges_the_calls():
    first, second = chat_episode(KEEPS)
    assert extends(first, second)
    assert merge_rows([first, second]) == [[first, second]]
    assert prefix_breaks([first, second]) == {"solver": 0}


def test_a_template_that_strips_earlier_reasoning_breaks_the_prefix():
    first, second = chat_episode(STRIPS)
    assert not extends(first, second)
    assert merge_rows([first, second]) == [[first], [second]]
    assert prefix_breaks([first, second]) == {"solver": 1}


def test_a_tool_call_the_template_renders_again_in_compact_json_breaks_the_prefix():
    # What the gateway renders for an agent's second call after a tool call: the template writes
    # the call's arguments again as compact JSON, not the tokens the model generated.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = Transition(
        rollout_id="r0",
        step=0,
        prompt_token_ids=encode(tokenizer, render_chat(tokenizer, TOOL_QUESTION, TOOLS)),
        response_token_ids=[*encode(tokenizer, TOOL_CALL_TEXT), end],
    )
    call = {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    messages = [
        *TOOL_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": call}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]  # fmt: skip
    text = render_chat(tokenizer, messages, TOOLS)
    assert '{"name":"add","arguments":{"a":2,"b":3}}' in text
    second = first.model_copy(
        update={"step": 1, "prompt_token_ids": encode(tokenizer, text), "response_token_ids": [5]}
    )
    assert not extends(first, second)
    assert prefix_breaks([first, second]) == {"unnamed": 1}


def test_only_consecutive_calls_of_one_agent_in_one_attempt_merge():
    a0, a1 = chat_episode(KEEPS)
    other_agent = a1.model_copy(update={"agent_name": "critic"})
    other_attempt = a1.model_copy(update={"attempt_id": "retry"})
    assert merge_rows([a0, other_agent]) == [[a0], [other_agent]]
    assert merge_rows([a0, other_attempt]) == [[a0], [other_attempt]]
    # Rows come in the order of their first calls (a0 is before b0), each in step order.
    b0, b1 = chat_episode(KEEPS, "r1")
    assert merge_rows([b1, a1, a0, b0]) == [[a0, a1], [b0, b1]]


def _trainer(**overrides) -> LoRATrainer:
    return LoRATrainer(TrainerConfig(model=str(tiny_model_dir()), learning_rate=1e-3, **overrides))


def _calls() -> list[Transition]:
    # Two rollouts that merge, one that breaks, and a single-call rollout: rows of 1 and 2 calls.
    return [
        *chat_episode(KEEPS, "r0", 1.0),
        *chat_episode(KEEPS, "r1", -0.5),
        *chat_episode(STRIPS, "r2", 0.7),
        chat_episode(KEEPS, "r3", -1.2)[0],
    ]


@functools.cache
def _policy_logprobs() -> tuple[tuple[float, ...], ...]:
    return tuple(map(tuple, _trainer(prefix_merge=False).response_logprobs(_calls())))


def with_behaviour(calls: Sequence[Transition], logprobs: Sequence[Sequence[float]]):
    """The calls with the behaviour logprobs of the policy that trains them (`logprobs`), every
    fifth token's raised by 0.3: ratios of 1 and e^-0.3 = 0.74, so that clipping and ratio
    masking act on some tokens and not on others."""
    return [
        t.model_copy(
            update={"response_logprobs": [lp + 0.3 * (k % 5 == 0) for k, lp in enumerate(lps)]}
        )
        for t, lps in zip(calls, logprobs, strict=True)
    ]


def _batch() -> list[Transition]:
    return with_behaviour(_calls(), _policy_logprobs())


@pytest.mark.parametrize("aggregation", get_args(Aggregation))
def test_the_merged_update_equals_the_unmerged_one(aggregation):
    batch = _batch()
    merged = _trainer(aggregation=aggregation, prefix_merge=True)
    apart = _trainer(aggregation=aggregation, prefix_merge=False)
    assert len(merged._rows(batch, True)) == 5 and len(apart._rows(batch, False)) == 7
    a, b = merged.step(batch), apart.step(batch)
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    assert a["train/forward_tokens_saved_frac"] > 0.2 and b["train/forward_tokens_saved_frac"] == 0
    assert a["train/prefix_breaks/solver"] == b["train/prefix_breaks/solver"] == 1
    changed = False
    for name, p in merged.lora_state().items():
        q = apart.lora_state()[name]
        assert torch.allclose(p, q, atol=1e-5, rtol=0), name
        changed |= not torch.equal(p, _trainer().lora_state()[name])
    assert changed


def test_gspo_and_ratio_masking_see_each_merged_call_as_its_own_sequence():
    batch = _batch()
    options = {"importance_ratio": "sequence", "ratio_mask": 1.2, "aggregation": "token-mean"}
    merged, apart = _trainer(prefix_merge=True, **options), _trainer(prefix_merge=False, **options)
    start = apart.lora_state()
    a, b = merged.step(batch), apart.step(batch)
    # The raised fifth of the tokens (ratio 0.74, outside [1/1.2, 1.2]) is masked, the rest not.
    assert 0.15 < b["train/ratio_masked_frac"] < 0.3
    assert a["train/ratio_masked_frac"] == pytest.approx(b["train/ratio_masked_frac"])
    other = apart.lora_state()
    assert any(not torch.equal(p, start[n]) for n, p in other.items())
    assert all(
        torch.allclose(p, other[n], atol=1e-5, rtol=0) for n, p in merged.lora_state().items()
    )


def test_response_logprobs_are_the_same_merged_or_not():
    batch = _batch()
    merged = _trainer(prefix_merge=True).response_logprobs(batch)
    apart = _trainer(prefix_merge=False).response_logprobs(batch)
    for m, a in zip(merged, apart, strict=True):
        assert m == pytest.approx(a, abs=1e-5)
