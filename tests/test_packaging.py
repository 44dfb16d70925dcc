"""What `pip install lightning-rl` puts on the path: nothing that shadows another distribution.

The example agents, tasks and flows install as `lightning_rl.agents`, `lightning_rl.tasks` and
`lightning_rl.flows`; `agents` stays the OpenAI Agents SDK's name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_of_python_files_is_a_listed_package():
    config = _setuptools()
    folder_of = {package: folder for package, folder in config["package-dir"].items()}
    listed = set(config["packages"])
    roots = {p for p in listed if "." not in p} | set(folder_of)
    expected = set(folder_of)  # each mapped folder, Python files of its own or not
    for package in roots:
        folder = ROOT / folder_of.get(package, package.replace(".", "/"))
        for path in folder.rglob("*.py"):
            rel = path.parent.relative_to(folder).parts
            expected.add(".".join((package, *rel)))
    assert listed == expected
    # Nothing installs under a top-level name other than these two.
    assert {p.split(".")[0] for p in listed} == {"lightning_core", "lightning_rl"}


def test_the_repository_folders_are_not_regular_packages():
    # A folder with __init__.py on the path (the repository root: tests, python -m) would win
    # over an installed package of the same name, the SDK's `agents` among them.
    for folder in _setuptools()["package-dir"].values():
        assert not (ROOT / folder / "__init__.py").exists(), folder


@pytest.mark.slow
def test_a_plain_install_beside_the_agents_sdk(tmp_path):
    """`pip install .` (not editable) with openai-agents in a new virtual environment: the SDK
    imports as `agents`, and the CLI runs."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The CPU build first, as the Makefile does: an unpinned torch would be a CUDA download.
    torch_version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__.split('+')[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run([*pip, f"torch=={torch_version}"], check=True, env=env, timeout=900)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [str(python), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        check=True,
        env=env,
        timeout=900,
    )
    (wheel,) = wheels.glob("lightning_rl-*.whl")
    subprocess.run([*pip, str(wheel), "openai-agents"], check=True, env=env, timeout=1800)

    elsewhere = tmp_path / "cwd"  # not the repository root: as a user's own project
    elsewhere.mkdir()
    done = subprocess.run(
        [
            str(python),
            "-c",
            "from agents import Agent, Runner; import agents, lightning_rl.flows.train; "
            "print(agents.__file__)",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "site-packages/agents/__init__.py" in done.stdout
    cli = subprocess.run(
        [str(venv / "bin" / "lightning-rl"), "--help"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    assert "train" in cli.stdout and "serve" in cli.stdout
