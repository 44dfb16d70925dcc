"""docs/tutorial.md, run as a user would (slow): its agent file written, its commands and Python
blocks run in order in an empty folder, with the tests' tiny model in place of SmolLM2.

What differs from a user's run is said on the page ("How this page is tested"): the model flag
added to `lightning-rl train`, `eval` and `production`; the blocks its source marks as skipped;
and PREFECT_API_URL pointing at the suite's shared Prefect server (the page's own advice for
keeping runs in a Prefect UI), so that the run starts no temporary one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PAGE = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
SKIP = "<!-- tutorial-test: skip"
# The model flag each command takes, added when the page names none.
TINY = {"train": "--model tiny", "eval": "--base-model tiny", "production": "--model tiny"}
# How long a command of the page may take with the tiny model on a busy 2-core machine.
COMMAND_TIMEOUT_S = 600


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, title, body) of each fenced block, less those after a skip marker."""
    found = []
    pattern = re.compile(r"(<!-- tutorial-test: skip[^\n]*\n)?```(\w+)([^\n]*)\n(.*?)\n```", re.S)
    for match in pattern.finditer(text):
        skipped, language, info, body = match.groups()
        if skipped:
            continue
        title = re.search(r'title="([^"]+)"', info)
        found.append((language, title.group(1) if title else "", body))
    return found


def commands(body: str) -> list[str]:
    """A bash block's commands: one a line, continuation lines joined, comments dropped."""
    joined = body.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def with_tiny_model(command: str) -> str:
    match = re.match(r"lightning-rl (train|eval|production)\b", command)
    if match is None or "--model " in command or "--base-model " in command:
        return command
    background = command.endswith("&")
    command = command.rstrip("&").rstrip()
    return f"{command} {TINY[match.group(1)]}" + (" &" if background else "")


def _run(command: str | list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A command of the page (a shell line, or a Python block's file), which must succeed."""
    done = subprocess.run(
        command,
        shell=isinstance(command, str),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
    return done


def _wait_for(url: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not answer within {deadline_s:.0f} s")


def test_the_tutorial_runs_as_written(tmp_path, prefect_api_env):
    text = PAGE.read_text()
    assert text.count(SKIP) == 2, "the page says two blocks are skipped: update it and this test"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    env |= prefect_api_env
    # The tests' interpreter's environment: `lightning-rl` and `mlflow` on PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    background: list[subprocess.Popen] = []
    ran = []
    try:
        for language, title, body in blocks(text):
            if title:
                (tmp_path / title).write_text(body + "\n")
            elif language == "python":
                script = tmp_path / f"block{len(ran)}.py"
                script.write_text(body + "\n")
                done = _run([sys.executable, str(script)], tmp_path, env)
                ran.append((body, done.stdout))
            elif language == "bash":
                for command in map(with_tiny_model, commands(body)):
                    if command.endswith("&"):
                        background.append(
                            subprocess.Popen(
                                command.rstrip("&"),
                                shell=True,
                                cwd=tmp_path,
                                env=env,
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                                start_new_session=True,
                            )
                        )
                        port = re.search(r"--port (\d+)", command)
                        if command.startswith("mlflow") and port:
                            _wait_for(f"http://127.0.0.1:{port.group(1)}/", 120)
                        ran.append((command, ""))
                        continue
                    done = _run(command, tmp_path, env)
                    ran.append((command, done.stdout + done.stderr))
    finally:
        for process in background:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)

    outputs = dict(ran)
    command, train = next((cmd, out) for cmd, out in ran if cmd.startswith("lightning-rl train"))
    assert "held-out tasks" in train and "registry:" in train, train
    assert (tmp_path / "runs" / "adder-1" / "checkpoint.json").is_file()
    iterations = int(re.search(r"--iterations (\d+)", command).group(1))
    analyze = next(out for cmd, out in ran if cmd.startswith("lightning-rl analyze"))
    rows = [line.split() for line in analyze.splitlines()[1:] if line.strip()]
    # An iteration each, as many as the page's train command asks for.
    assert [int(row[0]) for row in rows] == list(range(1, iterations + 1)), analyze
    command, evaluation = next((c, out) for c, out in ran if c.startswith("lightning-rl eval"))
    size = re.search(r"--eval-size (\d+)", command).group(1)
    assert "champion:" in evaluation and f"on {size} test tasks" in evaluation, evaluation
    served = [out for body, out in ran if "X-Lightning-Episode" in body]
    assert served and re.search(r"feedback [01]\.0 -> 201", served[0]), outputs
