"""A minimal agent and task loader for flow tests: one LLM call with the plain openai client.

Its reward (the parity of the reply's length) is arbitrary but a function of what the policy
wrote, so sampled groups get mixed rewards and the trainer real, non-zero advantages. With the
source "tiered", every other task is of tier "constant": its reward is always 1, so its groups
never carry a signal (what the curriculum and dynamic sampling must steer around).
"""

from __future__ import annotations

from typing import Any

import openai


def _reply(task: dict[str, Any], llm: Any, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=max_tokens,
        temperature=llm.sampling.get("temperature", 1.0),
        seed=llm.sampling.get("seed"),
    )
    return reply.choices[0].message.content or ""


def agent(task: dict[str, Any], llm: Any) -> float:
    reply = _reply(task, llm, max_tokens=8)
    if task.get("tier") == "constant":
        return 1.0
    return float(len(reply) % 2)


def load_tasks(split: str, size: int, source: str | None = None) -> list[dict[str, Any]]:
    offset = 0 if split == "train" else 10_000
    tasks = [{"id": f"{split}-{i}", "question": f"Say {offset + i}."} for i in range(size)]
    if source == "tiered":
        for i, task in enumerate(tasks):
            task["tier"] = "constant" if i % 2 else "parity"
    return tasks


# The bandit: one token per reply, reward 1 when it is TARGET. The test sets TARGET to a token
# the untrained (scaled) tiny model samples now and then, so the reward has room to rise and
# every group of rollouts of the same prompt carries a signal until it is learnt.
BANDIT_QUESTION = "Pick a word."
TARGET: str | None = None


def bandit_agent(task: dict[str, Any], llm: Any) -> float:
    return float(_reply(task, llm, max_tokens=1) == TARGET)


def bandit_tasks(split: str, size: int, source: str | None = None) -> list[dict[str, Any]]:
    return [{"id": f"{split}-{i}", "question": BANDIT_QUESTION} for i in range(size)]
