"""What `pip install lightning-rl` puts on the path: nothing that shadows another distribution.

The example agents, tasks and flows install as `lightning_rl.agents`, `lightning_rl.tasks` and
`lightning_rl.flows`; `agents` stays the OpenAI Agents SDK's name.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import tomllib
import zipfile
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
    """`pip install` of the built wheel (not editable) in a new virtual environment beside
    openai-agents: the wheel holds only its two packages, the SDK imports as `agents`, the
    requirements are met, and the CLI runs.

    The new environment sees this one's site-packages through a path file, below its own:
    resolving and unpacking torch, Prefect, MLflow and the SDK again took two of the suite's
    minutes and tests pip, not us (`make setup` resolves the same requirements). A path file
    does not run the path files of the folder it adds, so this environment's editable finder,
    which would map `lightning_rl` back to the repository, stays out."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    (mine,) = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.split()
    (Path(mine) / "beside.pth").write_text("\n".join(dict.fromkeys(site.getsitepackages())) + "\n")
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = tmp_path / "wheels"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
        env=env,
        timeout=600,
    )
    (wheel,) = wheels.glob("lightning_rl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lightning_core", "lightning_rl"}
    # --force-reinstall: the editable install it can see has the same name and version.
    subprocess.run(
        [*pip, "install", "--no-deps", "--force-reinstall", str(wheel)], check=True, env=env
    )
    # Its requirements are met (the demo model's package, installed --no-deps by the Makefile,
    # has unmet ones of its own that lightning-rl never imports).
    checked = subprocess.run(
        [str(python), "-m", "pip", "check"], capture_output=True, text=True, env=env
    ).stdout.splitlines()
    assert not [line for line in checked if line.startswith("lightning-rl ")], checked

    elsewhere = tmp_path / "cwd"  # not the repository root: as a user's own project
    elsewhere.mkdir()
    done = subprocess.run(
        [
            str(python),
            "-c",
            "from agents import Agent, Runner; import agents, lightning_rl.flows.train as t; "
            "print(agents.__file__); print(t.__file__)",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    sdk, train = done.stdout.split()
    assert sdk.endswith("site-packages/agents/__init__.py")
    assert train.startswith(mine)  # the wheel's copy, not the repository's
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
