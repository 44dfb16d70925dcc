"""The OpenAI Agents SDK, loaded whichever package the name `agents` finds first.

openai-agents installs its SDK as the top-level package `agents`: the name of this project's own
package of example agents. Where this project's package comes first on the path (the repository
root: tests, the CLI run from there), `import agents` finds it, and `from agents import Agent`
fails; elsewhere the SDK comes first and this package is reached through the editable install's
finder. So the SDK is taken from `sys.modules["agents"]` when that is the SDK; otherwise it is
loaded under the name `openai_agents_sdk`. Most of the SDK imports its own modules relatively,
which works under any name, but a few modules import `agents.<module>` absolutely; a finder
placed first on `sys.meta_path` answers those with the very module objects loaded under the
alias (never a second copy), and leaves the names of this project's subpackages alone.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ALIAS = "openai_agents_sdk"
SHADOWED = "agents"


class SDKNotInstalled(ModuleNotFoundError):
    """openai-agents is missing; the message says how to install it."""


def _is_sdk(module: ModuleType | None) -> bool:
    return module is not None and hasattr(module, "Runner") and hasattr(module, "function_tool")


class _AliasLoader(importlib.abc.Loader):
    """Hands out the module already loaded (or loaded now) under the alias."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Already executed under its alias name, and running it again would make a second copy;
        # only the spec, which the import system just replaced with this one, is put back.
        module.__spec__ = self._own_spec


class _SDKAliasFinder(importlib.abc.MetaPathFinder):
    """`agents.<sdk module>` -> `openai_agents_sdk.<sdk module>`, same objects."""

    def __init__(self, sdk_dir: Path, own_dir: Path) -> None:
        self._sdk_dir, self._own_dir = sdk_dir, own_dir

    def _ours(self, name: str) -> bool:
        return (self._own_dir / name).is_dir() or (self._own_dir / f"{name}.py").is_file()

    def _sdks(self, name: str) -> bool:
        return (self._sdk_dir / name / "__init__.py").is_file() or (
            self._sdk_dir / f"{name}.py"
        ).is_file()

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        head, _, rest = fullname.partition(".")
        if head != SHADOWED or not rest:
            return None
        first = rest.split(".", 1)[0]
        if self._ours(first) or not self._sdks(first):
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"{ALIAS}.{rest}"))


def _sdk_dir() -> Path:
    try:
        files = importlib.metadata.distribution("openai-agents")
    except importlib.metadata.PackageNotFoundError:
        raise SDKNotInstalled(
            "the rag agent needs the OpenAI Agents SDK: pip install 'lightning-rl[agents]'"
        ) from None
    found = Path(str(files.locate_file(SHADOWED)))
    if not (found / "__init__.py").is_file():
        raise SDKNotInstalled(f"openai-agents is installed but {found} holds no package")
    return found


def load_sdk() -> ModuleType:
    """The SDK's top-level module (`Agent`, `Runner`, `function_tool`, ...)."""
    for name in (SHADOWED, ALIAS):
        if _is_sdk(sys.modules.get(name)):
            return sys.modules[name]
    sdk_dir = _sdk_dir()
    own = sys.modules.get(SHADOWED)
    own_dirs = [Path(p) for p in getattr(own, "__path__", [])]
    if not any(isinstance(f, _SDKAliasFinder) for f in sys.meta_path):
        own_dir = own_dirs[0] if own_dirs else Path(__file__).resolve().parents[1]
        sys.meta_path.insert(0, _SDKAliasFinder(sdk_dir, own_dir))
    spec = importlib.util.spec_from_file_location(
        ALIAS, sdk_dir / "__init__.py", submodule_search_locations=[str(sdk_dir)]
    )
    if spec is None or spec.loader is None:
        raise SDKNotInstalled(f"cannot load the OpenAI Agents SDK from {sdk_dir}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its relative imports look the parent package up by name.
    sys.modules[ALIAS] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == ALIAS or n.startswith(f"{ALIAS}.")]:
            del sys.modules[name]
        raise
    return module
