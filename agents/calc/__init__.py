"""Calculator math agent (AutoGen AgentChat + a safe calculator tool) and its tasks."""

from lightning_rl.agents.calc.agent import agent
from lightning_rl.agents.calc.data import load_tasks

__all__ = ["agent", "load_tasks"]
