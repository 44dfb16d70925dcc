"""The rag agent's search tool, and what a search shows the model.

One document per search, the best BM25 match (`RESULTS_PER_SEARCH`). Each search the model makes
is recorded as a tool span (`emit_tool_result`, a no-op outside a training rollout) with whether
it brought a document the model had not read yet, which the rag profile's AIR rules reward.
"""

from __future__ import annotations

from typing import Any

import agents as sdk
from lightning_core.tracing import emit_tool_result
from lightning_rl.agents.rag import retrieval

TOOL_NAME = "search"
# Documents per search. The small model copies from the last document it read: with three,
# greedy SmolLM2-135M answered "What is the capital of India?" with Bhutan's capital, the third
# result for "India" (and Somalia's with Kenya's, the third for "Somalia"). With one, another
# country's facts take a search of their own.
RESULTS_PER_SEARCH = 1
NO_MATCH = "no document matches this query"


def results_text(query: str) -> str | None:
    """The search results for `query` as the tool returns them, one document a line."""
    return results(query)[1]


def results(query: str) -> tuple[list[str], str | None]:
    """The titles of the documents a search for `query` brings, and their text as the tool
    returns it (None: nothing matches)."""
    found = retrieval.search_titled(query, k=RESULTS_PER_SEARCH)
    return [title for title, _ in found], "\n".join(text for _, text in found) or None


def tool_output(query: str) -> str:
    """What a search for `query` shows the model: its result, or NO_MATCH."""
    return results_text(query) or NO_MATCH


def search_tool(seen: set[str], read: set[str] | None = None) -> Any:
    """The model's search tool for one question; `seen` holds the documents it has read (the
    agent's first search's), and grows with each search, and so does `read`, their titles."""

    async def search(query: str) -> str:
        """Search facts about countries."""
        # Async on purpose: the SDK awaits it in the rollout's context, where tracing finds it.
        titles, text = results(query)
        if read is not None:
            read.update(titles)
        if text is None:
            emit_tool_result(TOOL_NAME, success=False, error=NO_MATCH, query=query)
            return NO_MATCH
        # A search that brings back only what the model has read is a wasted turn (the base
        # model repeated one search until it ran out of turns in 7 of 40 questions).
        new_document = text not in seen
        seen.add(text)
        emit_tool_result(
            TOOL_NAME, success=True, output=text, query=query, new_document=new_document
        )
        return text

    return sdk.function_tool(search, name_override=TOOL_NAME)
