"""lightning_core is plain Python + torch: importing all of it loads neither Prefect nor MLflow,
and agents import nothing from the training side but the tracing API."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lightning_core_imports_neither_prefect_nor_mlflow():
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "lightning_core").rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow'))\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


AGENT_API = (
    "lightning_core.tracing",
    "lightning_core.envs.client",
    "lightning_core.envs.base",
    "lightning_core.envs.openenv",
)


def test_agents_import_only_tracing_from_lightning_core():
    for path in (ROOT / "agents").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                top = name.split(".")[0]
                assert top not in ("prefect", "mlflow"), f"{path}: {name}"
                assert not name.startswith(("lightning_rl.tasks", "lightning_rl.flows")), name
                if top == "lightning_core":
                    # Tracing, and the client of environment services (docs/environments.md).
                    assert name in AGENT_API, f"{path}: {name}"


def _imports(folder: Path) -> list[tuple[Path, str]]:
    found = []
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.append((path, node.module))
            elif isinstance(node, ast.Import):
                found += [(path, alias.name) for alias in node.names]
    return found


def test_the_store_does_not_import_the_gateway():
    for path, name in _imports(ROOT / "lightning_core" / "store"):
        assert not name.startswith(("lightning_core.gateway", "lightning_core.app")), (
            f"{path}: {name}"
        )
    # Nor through anything it imports: loading the store's server leaves the gateway unloaded.
    code = (
        "import sys, lightning_core.store.server, lightning_core.store.client\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('lightning_core.gateway'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_the_gateway_knows_the_store_only_by_its_protocol():
    for path, name in _imports(ROOT / "lightning_core" / "gateway"):
        if name.startswith("lightning_core.store"):
            assert name == "lightning_core.store.base", f"{path}: {name}"


def test_no_module_of_lightning_core_holds_more_than_600_lines():
    # A module holds one concept; past 600 lines it has always held two.
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in (ROOT / "lightning_core").rglob("*.py")
    }
    assert {p: n for p, n in sizes.items() if n > 600} == {}


# lightning_core's top level: the data model and errors everything shares, the composition
# of `lightning-rl serve` (settings, app) and the two modules user code imports (tracing for
# agents, feedback for production apps). The rest lives in a named part.
TOP_LEVEL = {"types", "errors", "semconv", "models", "settings", "app", "tracing", "feedback"}
PARTS = {
    "algo", "backends", "data", "envs", "gateway", "judge", "rollouts", "security", "serving",
    "stats", "store",
}  # fmt: skip

# What each part may import of lightning_core: each part sees only the parts below it, so the
# folders read as layers (security and serving at the bottom, the composition at the top).
ALLOWED = {
    "security": {"errors"},
    "serving": {"errors"},
    "models": {"errors"},
    "types": {"errors", "backends"},  # a call's grammar constraint is a backend's type
    "errors": set(),
    "semconv": set(),
    "tracing": {"errors", "security", "semconv", "types"},
    "feedback": {"errors", "security", "semconv", "types"},
    "backends": {"errors", "models", "security", "serving", "types", "semconv"},
    "store": {"errors", "security", "semconv", "serving", "types"},
    "gateway": {"backends", "errors", "security", "semconv", "serving", "store", "types"},
    "algo": {"backends", "errors", "models", "security", "semconv", "types"},
    "data": {"algo", "backends", "errors", "semconv", "types"},
    "judge": {"data", "errors", "semconv", "types"},
    "envs": {"errors", "security", "types"},
    "rollouts": {"data", "errors", "security", "semconv", "store", "tracing", "types"},
    "stats": {"errors", "rollouts", "store", "types"},
    "settings": {"errors", "gateway", "serving", "store"},
    "app": {"errors", "gateway", "serving", "store", "types"},
}


def _part(path: Path) -> str:
    parts = path.relative_to(ROOT / "lightning_core").parts
    return parts[0] if len(parts) > 1 else path.stem


def test_lightning_cores_top_level_holds_only_what_everything_uses():
    folder = ROOT / "lightning_core"
    modules = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
    packages = {p.parent.name for p in folder.glob("*/__init__.py")}
    assert modules == TOP_LEVEL
    assert packages == PARTS
    assert set(ALLOWED) == TOP_LEVEL | PARTS


def _layer_violations(imports: list[tuple[Path, str]]) -> list[str]:
    wrong = []
    for path, name in imports:
        if name == "lightning_core" or not name.startswith("lightning_core."):
            continue
        source, target = _part(path), name.split(".")[1]
        if target != source and target not in ALLOWED[source]:
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    return wrong


def test_each_part_of_lightning_core_imports_only_the_parts_below_it():
    assert _layer_violations(_imports(ROOT / "lightning_core")) == []


def test_the_layer_rule_sees_an_import_from_above():
    store, gateway = ROOT / "lightning_core/store/server.py", ROOT / "lightning_core/gateway/x.py"
    assert _layer_violations(
        [
            (store, "lightning_core.gateway.service"),
            (gateway, "lightning_core.app"),
            (gateway, "lightning_core.store.base"),
            (store, "lightning_core.store.schema"),
        ]
    ) == [
        "lightning_core/store/server.py imports lightning_core.gateway.service",
        "lightning_core/gateway/x.py imports lightning_core.app",
    ]


def test_every_module_in_tasks_holds_a_prefect_task():
    for path in (ROOT / "tasks").glob("*.py"):
        tree = ast.parse(path.read_text())
        decorated = [
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for d in node.decorator_list
            if "task" in ast.unparse(d).split("(")[0].split(".")
        ]
        assert decorated, f"{path.relative_to(ROOT)} holds no Prefect task"


def test_the_command_line_is_one_package():
    # Every `lightning-rl` command lives in flows/cli: nothing else builds a Typer app.
    outside = [
        str(path.relative_to(ROOT))
        for folder in ("lightning_core", "flows", "tasks", "registry", "agents")
        for path, name in _imports(ROOT / folder)
        if name.split(".")[0] == "typer" and "cli" not in path.relative_to(ROOT).parts
    ]
    assert outside == []


# The lightning_rl side, bottom to top: the shared layer (lightning_rl/: policy server, gpu slot,
# retries, progress, redaction), the MLflow registry, the Prefect tasks, the flows. Each folder
# imports only the ones below it; agents stay apart (test_agents_import_only_tracing...).
SIDE = {"lightning_rl": "shared", "registry": "registry", "tasks": "tasks", "flows": "flows"}
BELOW = {
    "shared": set(),
    "registry": {"shared"},
    "tasks": {"shared", "registry", "agents"},
    "flows": {"shared", "registry", "tasks", "agents"},
}


def _side_of(name: str) -> str | None:
    """Which folder of the lightning_rl side a module name belongs to (None: not this side)."""
    if not name.startswith("lightning_rl."):
        return None
    sub = name.split(".")[1]
    return sub if sub in ("registry", "tasks", "flows", "agents") else "shared"


def _side_violations(imports: list[tuple[Path, str]]) -> list[str]:
    wrong = []
    for path, name in imports:
        source, target = SIDE[path.relative_to(ROOT).parts[0]], _side_of(name)
        if target is not None and target != source and target not in BELOW[source]:
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    return wrong


def test_imports_run_down_from_flows_to_tasks_to_the_shared_layer():
    found = [pair for folder in SIDE for pair in _imports(ROOT / folder)]
    assert {path.relative_to(ROOT).parts[0] for path, _ in found} == set(SIDE)
    assert _side_violations(found) == []


def test_the_side_rule_sees_an_import_from_above():
    task, shared = ROOT / "tasks/rollouts.py", ROOT / "lightning_rl/progress.py"
    assert _side_violations(
        [
            (task, "lightning_rl.flows.pipeline"),
            (shared, "lightning_rl.tasks.rollouts"),
            (task, "lightning_rl.policy_server"),
            (shared, "lightning_core.errors"),
        ]
    ) == [
        "tasks/rollouts.py imports lightning_rl.flows.pipeline",
        "lightning_rl/progress.py imports lightning_rl.tasks.rollouts",
    ]
