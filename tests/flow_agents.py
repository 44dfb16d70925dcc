"""A minimal agent and task loader for flow tests: one LLM call with the plain openai client.

Its reward (the parity of the reply's length) is arbitrary but a function of what the policy
wrote, so sampled groups get mixed rewards and the trainer real, non-zero advantages. With the
source "tiered", every other task is of tier "constant": its reward is always 1, so its groups
never carry a signal (what the curriculum and dynamic sampling must steer around).
"""

from __future__ import annotations

from typing import Any

import openai


def agent(task: dict[str, Any], llm: Any) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=8,
        temperature=llm.sampling.get("temperature", 1.0),
        seed=llm.sampling.get("seed"),
    )
    if task.get("tier") == "constant":
        return 1.0
    return float(len(reply.choices[0].message.content or "") % 2)


def load_tasks(split: str, size: int, source: str | None = None) -> list[dict[str, Any]]:
    offset = 0 if split == "train" else 10_000
    tasks = [{"id": f"{split}-{i}", "question": f"Say {offset + i}."} for i in range(size)]
    if source == "tiered":
        for i, task in enumerate(tasks):
            task["tier"] = "constant" if i % 2 else "parity"
    return tasks
