"""The SQL agent: a LangGraph graph of three roles over one policy (the paper's Spider agent).

    writer ──> checker ──(CORRECT, or out of rounds)──> end
                  ^   └──(WRONG: reason)──> rewriter ──(rounds left)──┘
                                                  └──(last round)──> end

- the writer turns the question and the schema into a query;
- the checker runs the query with the SQL tool and reads the result, then answers CORRECT or
  WRONG with a reason; a query that failed is never accepted, so then the checker's LLM call
  is skipped and the tool's error is the feedback (a verdict there could change nothing);
- the rewriter fixes the query from the result and the feedback.

The writer and rewriter decode under the database's SQL grammar (grammar.py), sent with each
request as vLLM's `structured_outputs` grammar: their replies name only tables and columns the
database has and hold one query, nothing else. The gateway records the grammar with the call,
so training renormalises over what it allowed.

The roles share the policy and differ in their prompts; each has its own OpenAI client whose
requests carry the `X-Lightning-Agent` header with the role's name, so every LLM call is a
transition of agent "writer", "checker" or "rewriter" and training can pick which roles learn.
The final query is the last one written; the reward is its execution match with the gold query.
The only lightning-rl API used is tracing (`emit_tool_result`), a no-op outside training: each
query's tool span says whether it ran and how many rows it returned (`rows`), the signal the
profile's AIR rule turns into an intermediate reward for the call that wrote the query.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypedDict

import httpx
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel, Field

from lightning_core.tracing import emit_tool_result
from lightning_rl.agents.sql import tool
from lightning_rl.agents.sql.databases import schema_text
from lightning_rl.agents.sql.grammar import sql_grammar
from lightning_rl.agents.sql.prompts import (
    checker_messages,
    read_verdict,
    rewriter_messages,
    writer_messages,
)
from lightning_rl.agents.sql.reward import sql_reward
from lightning_rl.agents.sql.sql_text import extract_sql

WRITER, CHECKER, REWRITER = "writer", "checker", "rewriter"
AGENT_HEADER = "X-Lightning-Agent"


class SQLAgentConfig(BaseModel):
    """How long the agent may go on and how much each role may write."""

    max_rounds: int = Field(
        2, ge=0, description="Checker-rewriter rounds after the first query (the paper's K)."
    )
    sql_max_tokens: int = Field(
        128,
        ge=1,
        description="Completion cap of the writer and rewriter: the longest gold query is 66 "
        "tokens, so a fenced one with a lead-in fits and a rambling reply is cut short.",
    )
    check_max_tokens: int = Field(
        48, ge=1, description="Completion cap of the checker: a verdict and a short reason."
    )
    shown_rows: int = Field(5, ge=1, description="Result rows the checker and rewriter see.")
    timeout_ms: int = Field(
        tool.TIMEOUT_MS, ge=1, description="Time a query may run before the tool stops it."
    )
    constrain: bool = Field(
        True,
        description="Decode the writer's and rewriter's replies under the database's SQL "
        "grammar (grammar.py: only its tables and columns, one query ending in ';'), sent as "
        "vLLM's `structured_outputs` grammar; False: free text, the query found in it.",
    )


class SQLState(TypedDict, total=False):
    question: str
    db: str
    schema: str
    sql: str  # the latest query (empty when a reply held none)
    result: str  # what running it gave: a few rows, "no rows" or "error: ..."
    feedback: str  # the checker's reason when it judged the query wrong
    correct: bool
    rounds: int  # rewrites done


@dataclass(frozen=True)
class Roles:
    writer: ChatOpenAI
    checker: ChatOpenAI
    rewriter: ChatOpenAI


# Sampling keys that are ChatOpenAI fields; any other key goes into the request body as is.
_FIELDS = ("temperature", "top_p", "max_tokens", "seed", "stop", "n")


def chat_model(
    llm: Any,
    role: str,
    max_tokens: int,
    http_client: httpx.Client | None = None,
    http_async_client: httpx.AsyncClient | None = None,
    grammar: str | None = None,
) -> ChatOpenAI:
    """A LangChain chat model for one role on an endpoint with `base_url`, `model`,
    `api_key` and `sampling`; the endpoint's sampling wins over the role's defaults. With a
    `grammar`, every reply is decoded under it (vLLM's `structured_outputs` request field)."""
    sampling = {k: v for k, v in (getattr(llm, "sampling", None) or {}).items() if v is not None}
    fields = {k: sampling.pop(k) for k in _FIELDS if k in sampling}
    fields.setdefault("max_tokens", max_tokens)
    return ChatOpenAI(
        base_url=llm.base_url,
        model=llm.model,
        api_key=llm.api_key,
        default_headers={AGENT_HEADER: role},
        http_client=http_client,
        http_async_client=http_async_client,
        model_kwargs=sampling,
        extra_body={"structured_outputs": {"grammar": grammar}} if grammar else None,
        **fields,
    )


@contextlib.asynccontextmanager
async def roles(
    llm: Any, config: SQLAgentConfig, grammar: str | None = None
) -> AsyncIterator[Roles]:
    """The three role clients, sharing HTTP connections that are closed afterwards; the
    writer and rewriter decode under `grammar` when one is given.

    Own HTTP clients rather than LangChain's defaults: those are cached per base URL, and a
    rollout's base URL is new for every attempt.
    """
    sync_client, async_client = httpx.Client(), httpx.AsyncClient()
    try:

        def make(role: str, max_tokens: int, grammar: str | None = None) -> ChatOpenAI:
            return chat_model(llm, role, max_tokens, sync_client, async_client, grammar)

        yield Roles(
            writer=make(WRITER, config.sql_max_tokens, grammar),
            checker=make(CHECKER, config.check_max_tokens),
            rewriter=make(REWRITER, config.sql_max_tokens, grammar),
        )
    finally:
        sync_client.close()
        await async_client.aclose()


async def execute(db: str, sql: str, config: SQLAgentConfig) -> tuple[str, bool]:
    """Run the query with the SQL tool: (what the model is shown, whether it ran)."""
    try:
        result = await asyncio.to_thread(tool.run_sql, db, sql, tool.MAX_ROWS, config.timeout_ms)
    except tool.SQLError as exc:
        emit_tool_result("sql", success=False, error=str(exc), query=sql)
        return f"error: {exc}", False
    shown = tool.format_result(result, config.shown_rows)
    rows = len(result.rows)
    emit_tool_result(
        "sql", success=True, output=shown, query=sql, rows=rows, returned_rows=rows > 0
    )
    return shown, True


def build_graph(agents: Roles, config: SQLAgentConfig) -> Any:
    """The compiled writer -> checker -> rewriter graph."""

    async def write(state: SQLState) -> SQLState:
        messages = writer_messages(state["schema"], state["question"], state["db"])
        reply = await agents.writer.ainvoke(messages)
        return {"sql": extract_sql(reply.text), "rounds": 0}

    async def check(state: SQLState) -> SQLState:
        result, ran = await execute(state["db"], state["sql"], config)
        if not ran:
            # A failed query is never accepted: the error is the feedback, no LLM call needed.
            return {"result": result, "correct": False, "feedback": f"the query failed ({result})"}
        messages = checker_messages(state["schema"], state["question"], state["sql"], result)
        correct, feedback = read_verdict((await agents.checker.ainvoke(messages)).text)
        return {"result": result, "correct": correct, "feedback": feedback}

    async def rewrite(state: SQLState) -> SQLState:
        messages = rewriter_messages(
            state["schema"], state["question"], state["sql"], state["result"], state["feedback"]
        )
        reply = await agents.rewriter.ainvoke(messages)
        return {"sql": extract_sql(reply.text), "rounds": state["rounds"] + 1}

    def after_check(state: SQLState) -> str:
        return END if state["correct"] or state["rounds"] >= config.max_rounds else REWRITER

    def after_rewrite(state: SQLState) -> str:
        # The last rewrite is the answer: checking it could change nothing.
        return CHECKER if state["rounds"] < config.max_rounds else END

    graph = StateGraph(SQLState)
    graph.add_node(WRITER, write)
    graph.add_node(CHECKER, check)
    graph.add_node(REWRITER, rewrite)
    graph.add_edge(START, WRITER)
    graph.add_edge(WRITER, CHECKER)
    graph.add_conditional_edges(CHECKER, after_check, [REWRITER, END])
    graph.add_conditional_edges(REWRITER, after_rewrite, [CHECKER, END])
    return graph.compile()


async def solve(task: dict[str, Any], llm: Any, config: SQLAgentConfig | None = None) -> SQLState:
    """Run the graph on a task (`question` and `db`); returns its final state."""
    config = config or SQLAgentConfig()
    schema = await asyncio.to_thread(schema_text, task["db"])
    grammar = await asyncio.to_thread(sql_grammar, task["db"]) if config.constrain else None
    async with roles(llm, config, grammar) as agents:
        state: SQLState = {"question": task["question"], "db": task["db"], "schema": schema}
        # Each round is two nodes; the rest is headroom, never reached.
        limit = 4 + 2 * config.max_rounds
        return await build_graph(agents, config).ainvoke(state, {"recursion_limit": limit})


async def agent(task: dict[str, Any], llm: Any) -> float:
    """Rollout entry point: answer `task["question"]` on `task["db"]` with a SQL query;
    reward 1 when it returns what `task["gold_sql"]` returns, else 0."""
    final = await solve(task, llm)
    return await asyncio.to_thread(sql_reward, final.get("sql", ""), task)
