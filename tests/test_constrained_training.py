"""Constrained calls from span to trainer: the constraint travels with the transition, and the
trainer renormalises its logprobs over the same allowed tokens as decoding did, so that on
policy every importance ratio is 1 (a real tiny model, a real DuckDB store)."""

from __future__ import annotations

import asyncio

import duckdb
import pytest
import torch

from lightning_core import semconv
from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.backends.base import Constraint, GenerationRequest, SamplingParams
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.data.adapter import spans_to_transitions
from lightning_core.models import tiny_model_dir
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import RolloutRequest, Span, Transition

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _transition(constraint: Constraint | None, ids: list[int], logprobs: list[float]):
    return Transition(
        rollout_id="r",
        step=0,
        prompt_token_ids=[1, 2, 3, 4, 5],
        response_token_ids=ids,
        response_logprobs=logprobs,
        advantage=1.0,
        output_constraint=constraint,
    )


# A Lark grammar (vLLM's `structured_outputs` grammar) whose walks end within a few words.
LARK = 'start: WORD (" " WORD)? "."\nWORD: "red" | "green" | "blue" | "redder"'
CONSTRAINTS = {
    "json_schema": Constraint(kind="json_schema", json_schema=SCHEMA),
    "grammar": Constraint(kind="grammar", grammar=LARK),
}


@pytest.fixture(scope="module", params=sorted(CONSTRAINTS))
def constrained_sample(request):
    """Completions the backend sampled under a JSON schema, then under a Lark grammar, with
    the logprobs it recorded."""
    backend = TransformersBackend(model="tiny")
    params = SamplingParams(
        max_new_tokens=80, temperature=1.0, seed=3, constraint=CONSTRAINTS[request.param]
    )
    request = GenerationRequest(prompt_token_ids=[1, 2, 3, 4, 5], params=params, n=4)
    choices = asyncio.run(backend.generate(request))
    asyncio.run(backend.close())
    return params.constraint, choices


def test_the_trainer_reproduces_the_masked_behaviour_logprobs(constrained_sample):
    constraint, choices = constrained_sample
    trainer = LoRATrainer(TrainerConfig(model=str(tiny_model_dir())))
    batch = [_transition(constraint, c.token_ids, c.logprobs) for c in choices]
    x, masked, _ = trainer._tensors([[t] for t in batch])
    assert len(masked) == len(batch)
    with torch.no_grad():
        logp, _ = trainer._logprobs(x, masked)
        plain, _ = trainer._logprobs(x, [])
    on = x["mask"].bool()
    # A fresh LoRA adapter changes nothing: the trainer's policy is the one that sampled, and
    # with the grammar's renormalisation its logprobs are the recorded ones (ratio 1).
    torch.testing.assert_close(logp[on], x["old"][on], atol=2e-4, rtol=0)
    # Without it they are not: the mask moved real probability mass.
    assert (plain[on] - x["old"][on]).abs().max() > 1e-2


def test_a_step_on_constrained_transitions_is_on_policy(constrained_sample):
    constraint, choices = constrained_sample
    trainer = LoRATrainer(TrainerConfig(model=str(tiny_model_dir()), learning_rate=1e-3))
    batch = [_transition(constraint, c.token_ids, c.logprobs) for c in choices]
    metrics = trainer.step(batch)
    assert metrics["train/clip_frac"] == 0.0 and metrics["train/grad_norm"] > 0


@pytest.mark.parametrize(
    ("recorded", "constraint"),
    [
        (
            {semconv.CONSTRAINT: "json_schema", semconv.CONSTRAINT_SCHEMA: '{"type": "object"}'},
            Constraint(kind="json_schema", json_schema={"type": "object"}),
        ),
        (
            {semconv.CONSTRAINT: "grammar", semconv.CONSTRAINT_GRAMMAR: LARK},
            Constraint(kind="grammar", grammar=LARK),
        ),
    ],
)
def test_the_adapter_carries_the_constraint_from_the_span(recorded, constraint):
    attributes = {
        semconv.PROMPT_TOKEN_IDS: [1, 2],
        semconv.RESPONSE_COUNT: 1,
        semconv.RESPONSE.format(i=0, key="token_ids"): [7],
        semconv.RESPONSE.format(i=0, key="logprobs"): [-0.5],
        **recorded,
    }
    span = Span(
        rollout_id="r",
        attempt_id="a",
        trace_id="0" * 32,
        span_id="1" * 16,
        name="chat m",
        start_time=1.0,
        end_time=2.0,
        attributes=attributes,
    )
    [transition] = spans_to_transitions([span])
    assert transition.output_constraint == constraint


async def test_the_store_keeps_the_constraint_and_opens_older_databases(tmp_path):
    db = tmp_path / "old.duckdb"
    # A database from before the column existed.
    with duckdb.connect(str(db)) as con:
        con.execute(
            "CREATE TABLE transitions (rollout_id VARCHAR, attempt_id VARCHAR, step INTEGER, "
            "agent_name VARCHAR, prompt_token_ids INTEGER[], response_token_ids INTEGER[], "
            "response_logprobs DOUBLE[], reward DOUBLE, advantage DOUBLE, policy_version VARCHAR)"
        )
    store = DuckDBStore(db=str(db))
    try:
        [rollout] = await store.enqueue_rollouts([RolloutRequest(input="t")])
        constraint = CONSTRAINTS["grammar"]
        kept = _transition(constraint, [7, 8], [-0.1, -0.2])
        plain = _transition(None, [9], [-0.3])
        kept.rollout_id = plain.rollout_id = rollout.rollout_id
        plain.step = 1
        await store.add_transitions([kept, plain])
        got = await store.query_transitions([rollout.rollout_id])
    finally:
        await store.close()
    assert [t.output_constraint for t in sorted(got, key=lambda t: t.step)] == [constraint, None]
