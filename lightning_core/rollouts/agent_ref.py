"""Agent references: how a command line names the agent a runner runs.

`module.path:attr` imports `module.path` and takes its attribute `attr` (dots in `attr` walk
nested attributes, `module:Class.method`). A bare name such as `calc` is one of the example
agents: the package `lightning_rl.agents.calc` and its attribute `agent`. A dotted name without
a colon is a module whose attribute `agent` is taken.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from lightning_core.errors import InvalidInput

# The attribute an agent module exposes when the reference names only the module.
DEFAULT_ATTRIBUTE = "agent"
# Where bare names are looked up: the example agents shipped with the project.
EXAMPLES_PACKAGE = "lightning_rl.agents"
# What each kind of reference must be, for the message when it is not callable.
_CALLABLES = {
    "agent": "an agent is a function (task, llm) -> reward",
    "task loader": "a task loader is a function (split, size, source) -> list of task dicts",
}


def parse_agent_ref(ref: str) -> tuple[str, str]:
    """The module to import and the attribute path to take from it."""
    text = ref.strip()
    module, sep, attr = text.partition(":")
    if not sep:
        attr = DEFAULT_ATTRIBUTE
        if "." not in module:
            module = f"{EXAMPLES_PACKAGE}.{module}"
    parts = [*module.split("."), *attr.split(".")]
    if ":" in attr or not all(p.isidentifier() for p in parts):
        raise InvalidInput(
            f"agent reference {ref!r} is malformed: write 'package.module:function' or the "
            f"name of an example agent (e.g. 'calc' for {EXAMPLES_PACKAGE}.calc:agent)"
        )
    return module, attr


def load_agent(ref: str, what: str = "agent") -> Callable[..., Any]:
    """Import the agent `ref` names; InvalidInput saying what was tried when that fails.
    `what` names the reference in those messages ("task loader" for `--tasks`)."""
    module_name, attr = parse_agent_ref(ref)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # A module the agent itself imports may be what is missing: say which one.
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise InvalidInput(
                f"{what} {ref!r}: no module named {module_name!r}; check the spelling and that "
                "its package is installed or in the current directory"
            ) from exc
        raise InvalidInput(
            f"{what} {ref!r}: importing {module_name!r} failed because {missing!r} is not "
            "installed; install it (the example agents need `pip install lightning-rl[agents]`)"
        ) from exc
    except Exception as exc:
        raise InvalidInput(
            f"{what} {ref!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            close = difflib.get_close_matches(part, [n for n in dir(target) if n[:1] != "_"], 1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise InvalidInput(
                f"{what} {ref!r}: module {module_name!r} has no attribute {attr!r}; {hint}"
                f"write '{module_name}:<name of the {what} function>'"
            )
        target = getattr(target, part)
    if not callable(target):
        raise InvalidInput(
            f"{what} {ref!r}: {module_name}:{attr} is a {type(target).__name__}, not a "
            f"callable; {_CALLABLES.get(what, 'it must be a function')}"
        )
    return target
