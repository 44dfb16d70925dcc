"""A chat template that rewrites earlier turns, end to end: a real gateway serving the tiny model
with such a template records an agent's two calls; the second call's prompt does not extend the
first call's prompt and answer, so its transition is marked (`prefix_break` in the analytics
export) and the trainer counts it (`train/prefix_breaks/<agent>`), training each call on its
own tokens rather than on a concatenation the model never saw. The same agent under a template
that keeps earlier turns marks nothing."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.app import create_app
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.data import analytics
from lightning_core.data.collect import collect
from lightning_core.gateway.chat import encode, render_chat
from lightning_core.gateway.service import Gateway
from lightning_core.models import tiny_model_dir
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from tests.conftest import ThreadedServer
from tests.models import answering_model

KEEPS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like templates that drop earlier reasoning (Qwen3's strips what precedes </think>), this one
# rewrites every assistant turn before the last: the model never sees its own earlier tokens.
REWRITES = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}(earlier answer){% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
ANSWER = "The sum is 5."


def _model(folder: Path, template: str) -> Path:
    """The tiny model taught to answer QUESTION with ANSWER (a random model's tokens rarely
    survive decoding and encoding again, which breaks any prefix: not what is tested here),
    serving `template`. The first prompt is the same under both templates."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    prompt = encode(tokenizer, render_chat_with(tokenizer, KEEPS, QUESTION))
    shutil.copytree(answering_model([(prompt, ANSWER)]), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


def render_chat_with(tokenizer, template: str, messages: list[dict]) -> str:
    tokenizer.chat_template = template
    return render_chat(tokenizer, messages)


async def _episode(url: str, model: str) -> tuple[list, list]:
    """One rollout: a question, the model's answer, a follow-up with that answer in the
    history; then the rollout and its spans, as collecting reads them."""
    async with HttpStoreClient(url) as store:
        with httpx.Client(base_url=url) as http:
            [rollout] = http.post("/store/rollouts", json={"rollouts": [{"input": "t"}]}).json()
            claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
        attempt = claim["attempt"]["attempt_id"]
        prefix = f"{url}/rollouts/{rollout['rollout_id']}/attempts/{attempt}/v1"
        api = openai.AsyncOpenAI(base_url=prefix, api_key="-", max_retries=0)
        headers = {"X-Lightning-Agent": "solver"}
        messages = list(QUESTION)
        for follow_up in ("And times 4?", None):
            reply = await api.chat.completions.create(
                model=model, messages=messages, max_tokens=10, temperature=0, extra_headers=headers
            )
            if follow_up is None:
                break
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": follow_up},
            ]
        await api.close()
        await store.complete_attempt(attempt, 1.0)
        rollouts = await store.query_rollouts(rollout_ids=[rollout["rollout_id"]])
        return rollouts, await store.query_spans([rollout["rollout_id"]], "latest")


@pytest.mark.parametrize(
    ("template", "breaks"), [(KEEPS, 0), (REWRITES, 1)], ids=["keeps", "rewrites"]
)
def test_a_template_that_rewrites_earlier_turns_marks_the_transition_and_the_trainers_count(
    tmp_path, template, breaks
):
    store = DuckDBStore(db=":memory:")
    backend = TransformersBackend(model=str(_model(tmp_path / "model", template)), device="cpu")
    with ThreadedServer(create_app(store, gateway=Gateway(backend, store))) as server:
        rollouts, spans = asyncio.run(_episode(server.url, backend.base_model))
    collected = collect(rollouts, spans)
    first, second = collected.transitions
    assert second.agent_name == "solver"
    assert first.response_token_ids[:-1] == encode(backend.tokenizer, ANSWER)
    rows = analytics.transition_rows(collected.transitions, collected.facts)
    assert [r["prefix_break"] for r in rows] == [None, bool(breaks)]
    # The trainer counts the break, and trains each call on the tokens it was recorded with.
    for t in collected.transitions:
        t.advantage = 1.0
    trainer = LoRATrainer(TrainerConfig(model=str(tmp_path / "model"), learning_rate=1e-3))
    metrics = trainer.step(collected.transitions)
    assert metrics["train/prefix_breaks/solver"] == breaks
    assert metrics["train/prefix_breaks"] == breaks and metrics["train/loss"] != 0
