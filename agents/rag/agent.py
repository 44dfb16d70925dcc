"""The rag agent: an OpenAI Agents SDK agent that answers questions about countries by searching.

It is plain Agents SDK code pointed at an OpenAI-compatible endpoint; the only lightning-rl API
it uses is tracing (`emit_tool_result`, in tool.py), which does nothing outside a training
rollout. The agent searches for the question itself first and shows the model that search and
its result (see `solve`); the model then answers, `ANSWER: <answer>`, or searches again
(a multi-hop question's next country), within `MAX_TURNS` model calls. Running out of turns
counts as no answer, and so does a reply cut at MAX_TOKENS (the SDK refuses an incomplete
response).

Three settings make the SDK fit a self-hosted gateway and an offline machine:
- the SDK's default model class (the Responses API, which the gateway serves) on a client of
  the rollout's own endpoint, and sampling keys the Responses API lacks (stop, seed) in the
  request's body, where the gateway reads them;
- tracing off for the run: the SDK would otherwise send its traces to OpenAI's servers;
- worked examples (examples.py) and the first search as ordinary input items before the
  model's turn, so whichever way the gateway renders tool calls, they show them that way.
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

import agents as sdk
from lightning_rl.agents.rag.examples import examples_for, search_items
from lightning_rl.agents.rag.reward import reading_reward
from lightning_rl.agents.rag.tool import results, search_tool

AGENT_NAME = "rag"
INSTRUCTIONS = (
    "You answer questions about countries. Look facts up with the search tool, as many times "
    "as you need, then reply with ANSWER: followed by the short answer only."
)
# Model calls per question: up to three searches of its own, then the answer.
MAX_TURNS = 4
# A reply is one line and one sentence: a search or the answer. A reply that runs into
# MAX_TOKENS is no answer (the SDK refuses it), and the base model wrote sentences, 25 of its
# first 40 final replies cut there ("ANSWER: Bhutan is a Himalayan state located in Southern
# Asia. Its capital is..."): stopped at its first sentence, a wordy answer keeps its format.
# The price: "St. George's", the one test answer holding ". ", cannot be written.
MAX_TOKENS = 32
STOP = ["\n", ". "]

# The sampling keys ModelSettings takes by name; others go to the request as extra arguments.
_SETTINGS = ("temperature", "top_p", "max_tokens")


def model_settings(llm: Any) -> Any:
    """The SDK's ModelSettings from the endpoint's sampling (temperature, top_p, max_tokens,
    which the SDK sends as max_output_tokens); other keys (stop, seed) go into the request's
    body as they are: the Responses API client has no arguments for them."""
    sampling = {k: v for k, v in (getattr(llm, "sampling", None) or {}).items() if v is not None}
    sampling.setdefault("max_tokens", MAX_TOKENS)
    sampling.setdefault("stop", STOP)
    named = {k: sampling.pop(k) for k in _SETTINGS if k in sampling}
    return sdk.ModelSettings(**named, extra_body=sampling or None)


def build_agent(llm: Any, client: AsyncOpenAI, tool: Any) -> Any:
    """The SDK agent: the search tool, on the endpoint's model through the Responses API."""
    # The model class itself, not a name for the SDK's provider to resolve: names of served
    # models may hold a "/", which the provider reads as a prefix naming another provider.
    model = sdk.OpenAIResponsesModel(model=llm.model, openai_client=client)
    return sdk.Agent(
        name=AGENT_NAME,
        instructions=INSTRUCTIONS,
        tools=[tool],
        model=model,
        model_settings=model_settings(llm),
    )


async def solve(question: str, llm: Any, read: set[str] | None = None) -> str:
    """The agent's final reply to a question; "" when it runs out of turns. `read`, if given,
    gets the titles of the documents read (the first search's and the model's own).

    The agent makes the first search, for the question itself: BM25 ranks the document that
    answers it first for 204 of the 205 test questions that one document answers (of 306).
    The base model's own searches reached that document for 13 of 27 such questions among the
    first 40 (it searched "England" for London, "Africa" for Kenya). The model then answers, or
    searches the next country of a multi-hop question itself.
    """
    client = AsyncOpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key,
        default_headers={"X-Lightning-Agent": AGENT_NAME},
    )
    run_config = sdk.RunConfig(tracing_disabled=True, workflow_name=AGENT_NAME)
    first = search_items(question, "first-search")
    if read is not None:
        read.update(results(question)[0])
    try:
        result = await sdk.Runner.run(
            # The first search's document counts as read: searching it again is a wasted turn.
            build_agent(llm, client, search_tool({first[-1]["output"]}, read)),
            [*examples_for(question), {"role": "user", "content": question}, *first],
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
    """Rollout entry point: answer `task["question"]`; reward 0.1 * format + 0.9 * F1, or
    on a train task with `via` at least the credit for reading those documents (reward.py)."""
    read: set[str] = set()
    reply = await solve(task["question"], llm, read)
    return reading_reward(reply, str(task["answer"]), task.get("via"), read)
