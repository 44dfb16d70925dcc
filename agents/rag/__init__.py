"""Multi-hop question answering over country facts (OpenAI Agents SDK + BM25 search)."""

from lightning_rl.agents.rag.agent import agent
from lightning_rl.agents.rag.data import load_tasks

__all__ = ["agent", "load_tasks"]
