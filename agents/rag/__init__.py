"""Multi-hop question answering over country facts (OpenAI Agents SDK + BM25 search)."""

from agents.rag.agent import agent
from agents.rag.data import load_tasks

__all__ = ["agent", "load_tasks"]
