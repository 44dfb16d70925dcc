"""A minimal two-agent system for flow tests: agent "a" answers, then agent "b" answers too, each
naming itself with the X-Lightning-Agent header through the plain openai client.

Its reward (the parity of the two replies' total length) is arbitrary but a function of what
both agents wrote, so sampled groups get mixed rewards and both agents' calls real advantages.
"""

from __future__ import annotations

from typing import Any

import openai

AGENTS = ("a", "b")


def agent(task: dict[str, Any], llm: Any) -> float:
    replies = []
    for name in AGENTS:
        client = openai.OpenAI(
            base_url=llm.base_url,
            api_key=llm.api_key,
            max_retries=0,
            default_headers={"X-Lightning-Agent": name},
        )
        reply = client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": f"{name}: {task['question']}"}],
            max_tokens=8,
            temperature=llm.sampling.get("temperature", 1.0),
            seed=llm.sampling.get("seed"),
        )
        replies.append(reply.choices[0].message.content or "")
    return float(sum(len(r) for r in replies) % 2)


def load_tasks(split: str, size: int, source: str | None = None) -> list[dict[str, Any]]:
    offset = 0 if split == "train" else 10_000
    return [{"id": f"{split}-{i}", "question": f"Say {offset + i}."} for i in range(size)]
