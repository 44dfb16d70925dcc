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
                    assert name == "lightning_core.tracing", f"{path}: {name}"


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
