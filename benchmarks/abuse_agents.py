"""Hostile agents for the training part of benchmarks/abuse.py: one run, many attackers.

Every agent makes one honest chat call through the gateway with the plain openai client (as
tests/flow_agents.py does: reward = the parity of the reply's length). The task's `attack`
then decides what else it does with what a real agent holds, its endpoint and its agent key:

- none: nothing more (the honest rollouts whose training must go on; also every rollout whose
  sampling seed is even, so that each group mixes honest and hostile rollouts);
- huge_reward: writes a reward span of 1e200 on its own attempt and returns None, so that the
  span would be its episode's return;
- returns_huge: returns 1e200 as its reward;
- forged_call: writes an LLM-call span with token ids and logprobs it made up, on its own attempt;
- other_model: makes a call naming another model the server lists (GET /models under its own
  prefix), not the one its rollout is meant for;
- span_flood: writes spans in 4,000-span requests, FLOOD_REQUESTS of them.

What the server answered to each attack is appended to ATTACK_LOG (one JSON line per attack),
which the benchmark counts. Nothing here is a test of the agent: the run must finish.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import httpx
import openai
import orjson

from lightning_core import semconv

ATTACKS = ("none", "huge_reward", "returns_huge", "forged_call", "other_model", "span_flood")
FLOOD_SPANS, FLOOD_REQUESTS = 4_000, 3
# Where each attack's answer is appended (set by the benchmark before the run starts).
ATTACK_LOG_ENV = "LIGHTNING_ABUSE_ATTACK_LOG"


def load_tasks(split: str, size: int, source: str | None = None) -> list[dict[str, Any]]:
    """Tasks whose attack cycles through ATTACKS; the held-out split is all honest."""
    offset = 0 if split == "train" else 10_000
    tasks = []
    for i in range(size):
        attack = ATTACKS[i % len(ATTACKS)] if split == "train" else "none"
        tasks.append({"id": f"{split}-{i}", "question": f"Say {offset + i}.", "attack": attack})
    return tasks


def _ids(llm: Any) -> tuple[str, str, str]:
    """The server root, rollout id and attempt id, from the attempt's endpoint
    (<root>/rollouts/<rollout>/attempts/<attempt>/v1)."""
    root, rest = llm.base_url.split("/rollouts/", 1)
    rollout_id, rest = rest.split("/attempts/", 1)
    return root, rollout_id, rest.split("/", 1)[0]


def _span(rollout_id: str, attempt_id: str, name: str, attributes: dict) -> dict:
    now = time.time()
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "trace_id": f"{random.getrandbits(128):032x}",
        "span_id": f"{random.getrandbits(64):016x}",
        "name": name,
        "start_time": now,
        # Later than anything the gateway recorded: the forged call would be the latest.
        "end_time": now + 3600,
        "attributes": attributes,
    }


def _post_spans(llm: Any, spans: list[dict]) -> int | str:
    root, _, _ = _ids(llm)
    headers = {"authorization": f"Bearer {llm.api_key}"}
    try:
        answer = httpx.post(
            f"{root}/store/spans", json={"spans": spans}, headers=headers, timeout=60
        )
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return answer.status_code


def _log(attack: str, answer: Any) -> None:
    path = os.environ.get(ATTACK_LOG_ENV)
    if path:
        with open(path, "ab") as f:
            f.write(orjson.dumps({"attack": attack, "answer": answer}) + b"\n")


def _call(llm: Any, question: str, model: str | None = None) -> str:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    try:
        reply = client.chat.completions.create(
            model=model or llm.model,
            messages=[{"role": "user", "content": question}],
            max_tokens=8,
            temperature=llm.sampling.get("temperature", 1.0),
            seed=llm.sampling.get("seed"),
        )
    finally:
        client.close()
    return reply.choices[0].message.content or ""


def _other_model(llm: Any, question: str) -> Any:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    try:
        others = [m.id for m in client.models.list().data if m.id != llm.model]
    finally:
        client.close()
    if not others:
        return "no other model served"
    try:
        _call(llm, question, model=others[0])
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def agent(task: dict[str, Any], llm: Any) -> float | None:
    attack = task.get("attack", "none")
    # Every other rollout of a group attacks (by its sampling seed), so that a group mixes
    # honest and hostile returns: a group of equal returns has no spread to overflow.
    seed = llm.sampling.get("seed")
    if (seed if seed is not None else random.getrandbits(1)) % 2 == 0:
        attack = "none"
    if attack == "other_model":
        _log(attack, _other_model(llm, task["question"]))
    reply = _call(llm, task["question"])
    reward = float(len(reply) % 2)
    _, rollout_id, attempt_id = _ids(llm)
    if attack == "huge_reward":
        attributes = {semconv.REWARD_VALUE: 1e200, semconv.REWARD_NAME: "reward"}
        attributes[semconv.REWARD_PRIMARY] = True
        _log(
            attack,
            _post_spans(llm, [_span(rollout_id, attempt_id, semconv.REWARD_SPAN, attributes)]),
        )
        return None
    if attack == "returns_huge":
        _log(attack, "returned")
        return 1e200
    if attack == "forged_call":
        attributes = {
            semconv.PROMPT_TOKEN_IDS: [1, 2, 3],
            semconv.RESPONSE.format(i=0, key="token_ids"): [4, 5, 6],
            semconv.RESPONSE.format(i=0, key="logprobs"): [-0.1, -0.1, -0.1],
            semconv.RESPONSE.format(i=0, key="finish_reason"): "stop",
            semconv.RESPONSE_COUNT: 1,
            semconv.POLICY_VERSION: llm.model,
        }
        span = _span(rollout_id, attempt_id, f"chat {llm.model}", attributes)
        _log(attack, _post_spans(llm, [span]))
    if attack == "span_flood":
        for _ in range(FLOOD_REQUESTS):
            spans = [
                _span(rollout_id, attempt_id, "flood", {"x": "y" * 16}) for _ in range(FLOOD_SPANS)
            ]
            _log(attack, _post_spans(llm, spans))
    return reward
