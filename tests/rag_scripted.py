"""A scripted Responses endpoint that plays the rag agent's model, for tests without a model."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request

ANSWER = "ANSWER: Paris"


def _own_searches(items: list[dict[str, Any]]) -> int:
    """Searches the scripted model made in this conversation: its calls' ids are its own
    ("call_<n>"), unlike the agent's first search's and the worked examples'."""
    return sum(
        1
        for item in items
        if item.get("type") == "function_call" and str(item.get("call_id")).startswith("call_")
    )


def scripted_endpoint(requests: list[dict[str, Any]], searches: dict[str, list[str]]) -> FastAPI:
    """Replies by question: the searches `searches[question]` lists, in turn, then `ANSWER`; a
    question not listed searches "France" for ever. Serves /v1/responses, plain and under a
    rollout attempt's prefix (as the runner's endpoints are), and records every request body."""
    app = FastAPI()

    async def respond(request: Request) -> dict[str, Any]:
        body = await request.json()
        body["agent_header"] = request.headers.get("x-lightning-agent")
        requests.append(body)
        question = [m for m in body["input"] if m.get("role") == "user"][-1]["content"]
        script, made = searches.get(question), _own_searches(body["input"])
        if script is not None and made >= len(script):
            text = {"type": "output_text", "text": ANSWER, "annotations": []}
            item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed"}
            output = {**item, "content": [text]}
        else:
            query = script[made] if script is not None else "France"
            output = {
                "id": f"fc_{len(requests)}",
                "type": "function_call",
                "call_id": f"call_{len(requests)}",
                "name": "search",
                "arguments": json.dumps({"query": query}),
                "status": "completed",
            }
        return {
            "id": f"resp_{len(requests)}",
            "object": "response",
            "created_at": 0,
            "status": "completed",
            "model": body["model"],
            "output": [output],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": body["tools"],
            "usage": {
                "input_tokens": 1,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": 1,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 2,
            },
        }

    app.post("/v1/responses")(respond)
    app.post("/rollouts/{rollout_id}/attempts/{attempt_id}/v1/responses")(respond)
    return app
