"""Text-to-SQL multi-agent (LangGraph: writer, checker, rewriter) and its tasks."""

from lightning_rl.agents.sql.agent import agent
from lightning_rl.agents.sql.data import load_tasks

__all__ = ["agent", "load_tasks"]
