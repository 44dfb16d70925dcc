"""The rag agent: an OpenAI Agents SDK agent that answers questions about countries by searching.

It is plain Agents SDK code pointed at an OpenAI-compatible endpoint; the only lightning-rl API
it uses is tracing (`emit_tool_result`), which does nothing outside a training rollout. The model
decides each turn whether to search again or to answer, `ANSWER: <answer>`, within `MAX_TURNS`
model calls; running out of turns counts as no answer, and so does a reply cut at MAX_TOKENS
(the SDK refuses an incomplete response).

Three settings make the SDK fit a self-hosted gateway and an offline machine:
- the SDK's default model class (the Responses API, which the gateway serves) on a client of
  the rollout's own endpoint, and sampling keys the Responses API lacks (stop, seed) in the
  request's body, where the gateway reads them;
- tracing off for the run: the SDK would otherwise send its traces to OpenAI's servers;
- two worked examples as ordinary input items before the question, so whichever way the
  gateway renders tool calls, the examples show them that way.
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

from agents.rag import retrieval
from agents.rag.reward import answer_reward
from agents.rag.sdk import load_sdk
from lightning_core.tracing import emit_tool_result

sdk = load_sdk()

AGENT_NAME = "rag"
INSTRUCTIONS = (
    "You answer questions about countries. Look facts up with the search tool, as many times "
    "as you need, then reply with ANSWER: followed by the short answer only."
)
# Model calls per question: up to three searches, then the answer.
MAX_TURNS = 4
# A reply is one line, a search or the answer: it stops at the line's end, and a cap keeps a
# rambling line cheap.
MAX_TOKENS = 32
STOP = ["\n"]
NO_MATCH = "no document matches this query"

# The sampling keys ModelSettings takes by name; others go to the request as extra arguments.
_SETTINGS = ("temperature", "top_p", "max_tokens")


def results_text(query: str) -> str | None:
    """The search results for `query` as the tool returns them, one document a line."""
    found = retrieval.search(query)
    return "\n".join(found) if found else None


async def search(query: str) -> str:
    """Search facts about countries."""
    # Async on purpose: the SDK awaits it in the rollout's context, where tracing finds it.
    text = results_text(query)
    if text is None:
        emit_tool_result("search", success=False, error=NO_MATCH, query=query)
        return NO_MATCH
    emit_tool_result("search", success=True, output=text, query=query)
    return text


SEARCH_TOOL = sdk.function_tool(search, name_override="search")


def _worked_example(question: str, queries: tuple[str, ...], answer: str) -> list[dict[str, Any]]:
    """A question, a search per query with its real result, and the answer, as input items."""
    items: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for query in queries:
        call_id = f"example-{len(items)}"
        items += [
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "search",
                "arguments": json.dumps({"query": query}),
            },
            {
                "type": "function_call_output",
                "call_id": call_id,
                "output": results_text(query) or NO_MATCH,
            },
        ]
    items.append({"role": "assistant", "content": f"ANSWER: {answer}"})
    return items


def _examples() -> list[dict[str, Any]]:
    """One search then the answer; two searches (the second for the bridge) then the answer.

    With only the second, greedy SmolLM2-135M answered in the format 5 times in 16; with both,
    16 times in 16, and it searched every time.
    """
    # No task asks about these countries (data.EXAMPLE_COUNTRIES): copying an example must not pay.
    return [
        *_worked_example(
            "Which language is spoken in the country whose capital is Warsaw?",
            ("Warsaw",),
            "Polish",
        ),
        *_worked_example(
            "Portugal borders exactly one country. What is the capital of that country?",
            ("Portugal", "Spain"),
            "Madrid",
        ),
    ]


def model_settings(llm: Any) -> Any:
    """The SDK's ModelSettings from the endpoint's sampling (temperature, top_p, max_tokens,
    which the SDK sends as max_output_tokens); other keys (stop, seed) go into the request's
    body as they are: the Responses API client has no arguments for them."""
    sampling = {k: v for k, v in (getattr(llm, "sampling", None) or {}).items() if v is not None}
    sampling.setdefault("max_tokens", MAX_TOKENS)
    sampling.setdefault("stop", STOP)
    named = {k: sampling.pop(k) for k in _SETTINGS if k in sampling}
    return sdk.ModelSettings(**named, extra_body=sampling or None)


def build_agent(llm: Any, client: AsyncOpenAI) -> Any:
    """The SDK agent: the search tool, on the endpoint's model through the Responses API."""
    # The model class itself, not a name for the SDK's provider to resolve: names of served
    # models may hold a "/", which the provider reads as a prefix naming another provider.
    model = sdk.OpenAIResponsesModel(model=llm.model, openai_client=client)
    return sdk.Agent(
        name=AGENT_NAME,
        instructions=INSTRUCTIONS,
        tools=[SEARCH_TOOL],
        model=model,
        model_settings=model_settings(llm),
    )


async def solve(question: str, llm: Any) -> str:
    """The agent's final reply to a question; "" when it runs out of turns."""
    client = AsyncOpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key,
        default_headers={"X-Lightning-Agent": AGENT_NAME},
    )
    run_config = sdk.RunConfig(tracing_disabled=True, workflow_name=AGENT_NAME)
    try:
        result = await sdk.Runner.run(
            build_agent(llm, client),
            [*_examples(), {"role": "user", "content": question}],
            max_turns=MAX_TURNS,
            run_config=run_config,
        )
    except (sdk.MaxTurnsExceeded, sdk.ModelBehaviorError):
        # Out of turns, or a reply the SDK refuses (cut at MAX_TOKENS: an incomplete response).
        return ""
    finally:
        await client.close()
    return str(result.final_output or "")


async def agent(task: dict[str, Any], llm: Any) -> float:
    """Rollout entry point: answer `task["question"]`; reward 0.1 * format + 0.9 * F1."""
    reply = await solve(task["question"], llm)
    return answer_reward(reply, str(task["answer"]))
