"""Shared-prefix forward passes (shared_prefix.py): the rows of a micro-batch that begin alike
compute their shared prefix once, and train exactly as they would apart."""

from __future__ import annotations

import functools
import random
from typing import get_args

import pytest
import torch

from lightning_core.algo.config import Aggregation, TrainerConfig
from lightning_core.algo.prefix import row_length
from lightning_core.algo.shared_prefix import (
    MIN_SHARED_TOKENS,
    forward_cost,
    order_key,
    pack,
    shared_length,
)
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.models import tiny_model_dir
from lightning_core.types import Transition
from tests.test_prefix_merge import with_behaviour

_rng = random.Random(7)
SYSTEM = [_rng.randrange(10, 1000) for _ in range(48)]  # every prompt starts with it


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _call(rollout: str, step: int, prompt: list[int], response: list[int], adv: float):
    return Transition(
        rollout_id=rollout,
        step=step,
        agent_name="solver",
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=[-7.0] * len(response),
        advantage=adv,
    )


@functools.cache
def _calls() -> tuple[Transition, ...]:
    """Two tasks of a group of three rollouts each, over one system prompt: most rollouts make
    one call, one makes two that extend each other (a merged row, longer than the others), and
    one call's prompt rewrites the first (a row of its own sharing only the system prompt)."""
    calls = []
    for task in range(2):
        prompt = SYSTEM + _tokens(20 + 5 * task, seed=task)
        for g in range(3):
            rollout = f"t{task}-r{g}"
            response = _tokens(4 + g, seed=100 * task + g)
            adv = (-1.0) ** g * (0.5 + 0.25 * g + task)
            calls.append(_call(rollout, 0, prompt, response, adv))
            if g == 1:
                follow = prompt + response + _tokens(9, seed=50 + task)
                calls.append(_call(rollout, 1, follow, _tokens(3, seed=60 + task), adv))
    calls.append(_call("other", 0, SYSTEM + _tokens(11, seed=99), _tokens(5, seed=98), 0.8))
    return tuple(calls)


def _trainer(**overrides) -> LoRATrainer:
    return LoRATrainer(TrainerConfig(model=str(tiny_model_dir()), learning_rate=1e-3, **overrides))


@functools.cache
def _policy_logprobs() -> tuple[tuple[float, ...], ...]:
    return tuple(map(tuple, _trainer(prefix_share=False).response_logprobs(list(_calls()))))


def _batch() -> list[Transition]:
    return with_behaviour(_calls(), _policy_logprobs())


def _same_update(options: dict, objective: str = "policy_gradient") -> tuple[dict, dict]:
    batch = _batch()
    shared, apart = _trainer(prefix_share=True, **options), _trainer(prefix_share=False, **options)
    start = apart.lora_state()
    a, b = shared.step(batch, objective), apart.step(batch, objective)
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    after = apart.lora_state()
    assert any(not torch.equal(p, start[n]) for n, p in after.items())
    for name, p in shared.lora_state().items():
        assert torch.allclose(p, after[name], atol=1e-5, rtol=0), name
    return a, b


@pytest.mark.parametrize("aggregation", get_args(Aggregation))
def test_the_shared_update_equals_the_unshared_one(aggregation):
    a, b = _same_update({"aggregation": aggregation})
    # The merged row (prefix merging) is saved either way; sharing also leaves out the repeats
    # of the prompts: each task's three rows and the system prompt of the last row.
    assert a["train/forward_tokens_saved_frac"] > b["train/forward_tokens_saved_frac"] + 0.3
    assert a["train/prefix_breaks/solver"] == b["train/prefix_breaks/solver"]


@pytest.mark.parametrize(
    "options",
    [
        {"importance_ratio": "sequence", "ratio_mask": 1.2, "aggregation": "seq-mean-token-mean"},
        {"kl_coef": 0.5, "tis_cap": 2.0},
        {"prefix_merge": False},
    ],
    ids=["gspo-and-masking", "kl-and-tis", "unmerged"],
)
def test_every_objective_trains_the_same_shared(options):
    a, b = _same_update(options)
    assert a["train/ratio_masked_frac"] == pytest.approx(b["train/ratio_masked_frac"])
    assert a["train/kl"] == pytest.approx(b["train/kl"], abs=1e-6)


def test_the_likelihood_trains_the_same_shared():
    _same_update({}, objective="likelihood")


def test_response_logprobs_and_the_behaviour_gap_are_the_same_shared_or_not():
    batch = _batch()
    shared, apart = _trainer(prefix_share=True), _trainer(prefix_share=False)
    for s, a in zip(shared.response_logprobs(batch), apart.response_logprobs(batch), strict=True):
        assert s == pytest.approx(a, abs=1e-5)
    gap, other = shared.behaviour_gap(batch), apart.behaviour_gap(batch)
    assert gap["offline/behaviour_kl"] == pytest.approx(other["offline/behaviour_kl"], abs=1e-6)


def test_a_group_is_one_micro_batch_whose_prompt_counts_once():
    trainer = _trainer(micro_batch_tokens=160)
    rows = trainer._rows(_batch(), merge=True)
    assert rows == sorted(rows, key=order_key)
    batches = trainer._micro_batches(rows)
    # Budget 160: a task's three rows fit (prompt ~70 once, plus three short rests) where
    # three padded whole rows (3 x 90) would not.
    for batch in batches:
        assert forward_cost(batch) <= 160 or len(batch) == 1
    by_task = [{row[0].rollout_id.split("-")[0] for row in batch} for batch in batches]
    assert {"t0"} in by_task and {"t1"} in by_task
    assert max(len(b) for b in batches) >= 3


def test_the_shared_prefix_stops_before_the_first_target_and_below_the_minimum():
    long = SYSTEM + _tokens(30, seed=1)
    a = [_call("a", 0, long, [1, 2], 1.0)]
    b = [_call("b", 0, long, [3], 1.0)]
    # Equal prompts: shared up to, not including, the prompt's last token (its logits predict
    # the first response token, which the loss reads).
    assert shared_length([a, b]) == len(long) - 1
    # Prompts agreeing on fewer than MIN_SHARED_TOKENS tokens are computed whole.
    c = [_call("c", 0, [*long[: MIN_SHARED_TOKENS - 1], 5, 6, 7], [4], 1.0)]
    assert shared_length([a, c]) == 0
    assert shared_length([a]) == 0
    assert forward_cost([a, b]) == (len(long) - 1) + 2 * (row_length(a) - len(long) + 1)
    # A row longer than the budget is a micro-batch alone; the rest pack around it.
    assert pack([a, b, c], budget=10) == [[a], [b], [c]]


def test_sharing_is_off_with_gradient_checkpointing():
    trainer = _trainer(gradient_checkpointing=True)
    assert not trainer._sharing()
    assert _trainer()._sharing()
