"""Calculator math agent (AutoGen AgentChat + a safe calculator tool) and its tasks."""

from agents.calc.agent import agent
from agents.calc.data import load_tasks

__all__ = ["agent", "load_tasks"]
