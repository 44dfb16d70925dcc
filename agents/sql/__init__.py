"""Text-to-SQL multi-agent (LangGraph: writer, checker, rewriter) and its tasks."""

from agents.sql.agent import agent
from agents.sql.data import load_tasks

__all__ = ["agent", "load_tasks"]
