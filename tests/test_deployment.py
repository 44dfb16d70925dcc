"""prefect.yaml as a team uses it: a local Prefect server, `prefect deploy --all`, a process
worker, and `prefect deployment run 'train/calc' --watch` ending Completed (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_core.data.task_table import TaskTable
from lightning_rl.agents.calc.data import fresh_tasks
from tests.conftest import free_port
from tests.helpers import wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]


def test_train_deployment_runs_to_completed_through_a_worker(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_CLI_PROMPT": "false",
    }
    logs = tmp_path / "logs"
    logs.mkdir()
    with (logs / "server.log").open("w") as server_log, (logs / "worker.log").open("w") as log:
        _deploy_and_run(env, api, port, logs, server_log, log, tmp_path)


def _deploy_and_run(env, api, port, logs, server_log, worker_log, tmp_path) -> None:
    server = subprocess.Popen(
        [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env={k: v for k, v in env.items() if k != "PREFECT_API_URL"},
        stdout=server_log,
        stderr=subprocess.STDOUT,
    )
    worker = None
    try:
        wait_healthy(api, server, what="prefect server")

        def prefect(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
            done = subprocess.run(
                [*PREFECT, *args],
                env=env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
            return done

        prefect("work-pool", "create", "lightning-process", "--type", "process")
        prefect("gcl", "create", "gpu", "--limit", "1")
        deployed = prefect("deploy", "--all", "--no-prompt")
        for name in ("calc", "sql", "rag"):
            assert f"train/{name}" in deployed.stdout
            assert f"evaluate/{name}-champion" in deployed.stdout
        worker = subprocess.Popen(
            [*PREFECT, "worker", "start", "--pool", "lightning-process"],
            env=env,
            cwd=REPO,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
        )
        # Prefect merges a run's parameters over the deployment's one name deep: a section
        # given here replaces the deployment's (data, which it does not give, stays).
        params = {
            "server": {"model": "tiny"},
            "iterations": 1,
            "rollouts": {
                "tasks_per_iteration": 2,
                "group_size": 2,
                "rollout_workers": 1,
                "rollout_concurrency": 2,
            },
            # The deployment pins the 200-task calc benchmark; this run evaluates on 3 tasks.
            "evaluation": {"eval_size": 3, "benchmark_id": None},
            "run_dir": str(tmp_path / "runs"),
            "run_name": "deployed",
            "registry": {
                "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
                "registered_model": "deployed-calc",
            },
        }

        def run_deployment(run_params: dict) -> str:
            run = prefect(
                "deployment",
                "run",
                "train/calc",
                "--param",
                "iterations=1",
                "--params",
                json.dumps(run_params),
                "--watch",
                "--watch-timeout",
                "600",
                timeout=700,
            )
            worker_tail = (logs / "worker.log").read_text()[-3000:]
            assert "Completed" in run.stdout, run.stdout + worker_tail
            return run.stdout

        def run_logged(run_stdout: str, text: str, within_s: float = 180) -> str:
            # The run's log as Prefect's API keeps it (what the UI and `prefect flow-run logs`
            # show), not the worker's relay of the flow process's terminal: under the whole
            # suite's load that relay once never held the line. Log batches reach the API a few
            # seconds after the run completes, so wait for the line rather than read once.
            flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", run_stdout).group(1)
            deadline = time.monotonic() + within_s
            while True:
                # Words only: the CLI wraps long lines to the terminal's width.
                logged = " ".join(prefect("flow-run", "logs", flow_run_id).stdout.split())
                if text in logged or time.monotonic() > deadline:
                    return logged
                time.sleep(2)

        # The weekly schedule's run with no new tasks in the table: it says so, trains nothing.
        empty = run_deployment({**params, "run_name": "deployed-empty"})
        logged = run_logged(empty, "no new tasks")
        assert "no new tasks" in logged, logged[-3000:] + (logs / "worker.log").read_text()[-3000:]
        assert not (tmp_path / "runs" / "deployed-empty").exists()
        # A week of new tasks appended: the next run trains on them, and on them only.
        TaskTable(tmp_path / "runs" / "data" / "calc-tasks").append(fresh_tasks(4, seed=1))
        run_deployment(params)
        summary = json.loads((tmp_path / "runs" / "deployed" / "summary.json").read_text())
        assert summary["iterations"] == 1 and summary["policy_version"] == "deployed-v1"
        assert summary["data"]["source"] == "new_tasks" and summary["data"]["rows"] == 4
        # A parameter the flow's config refuses fails the run's creation, not deep inside it.
        bad = subprocess.run(
            [*PREFECT, "deployment", "run", "train/calc", "--param", "iterations=many"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode != 0
    finally:
        for proc in (worker, server):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
