"""The training flow's rollouts on a real Dask and a real Ray cluster (task_runner "dask" and
"ray"): tiny model, real policy server, MLflow on SQLite, a real Prefect run.

The proof that run-rollouts ran on the cluster and not in the flow's own process: every
attempt in the store names its worker `runner-<host>-<pid>-<n>`
(lightning_core/rollouts/runner.py), so the training rollouts' attempts must carry the PIDs of
cluster workers, never this process's.
Held-out evaluation stays on the flow's threads, so its attempts carry this PID (a control that
the signal is read right).

Dask: no address, so the DaskTaskRunner starts a local cluster of worker processes. Ray: a head
started apart with `ray start`, reached by task_runner_address, and the API key handed over as
on other machines: in LIGHTNING_API_KEY of the flow and of the Ray node, not in a file.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import pytest
from prefect import unmapped

from lightning_rl import progress
from lightning_rl.flows import batch_source as batch_source_module
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.train import train
from lightning_rl.registry.config import RegistryConfig
from tests.conftest import free_port

TASKS, GROUP = 2, 2
KEY = "cluster-test-key"


class _Recorder:
    """A cluster task runner that records what it was asked to map."""

    def __init__(self) -> None:
        self.parameters: dict | None = None

    def __enter__(self) -> _Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def map(self, task: object, parameters: dict) -> list:
        self.parameters = parameters
        return []


@pytest.mark.parametrize(
    ("address", "api_key", "key_file", "run_dir"),
    [
        (None, None, "run/store.duckdb.key", "run"),  # a local cluster shares this machine
        (None, KEY, None, "run"),
        ("10.0.0.5:6379", None, "run/store.duckdb.key", None),
        ("10.0.0.5:6379", KEY, None, None),
    ],
)
def test_cluster_workers_get_no_paths_they_cannot_reach(
    monkeypatch, address, api_key, key_file, run_dir
):
    # Workers elsewhere cannot read the key file or append to the run folder (paths on the
    # flow's machine): with LIGHTNING_API_KEY they use their own, with an address no run folder.
    recorder = _Recorder()
    monkeypatch.setattr(batch_source_module, "_cluster_runner", lambda config: recorder)
    if api_key is None:
        monkeypatch.delenv("LIGHTNING_API_KEY", raising=False)
    else:
        monkeypatch.setenv("LIGHTNING_API_KEY", api_key)
    config = TrainConfig(task_runner="ray", task_runner_address=address)
    parameters = {
        "worker": [0, 1],
        "key_file": unmapped("run/store.duckdb.key"),
        "run_dir": unmapped("run"),
    }
    batch_source_module.fan_out(config, parameters)
    sent = recorder.parameters
    assert sent is not None and sent["worker"] == [0, 1]
    assert (sent["key_file"].value, sent["run_dir"].value) == (key_file, run_dir)
    assert parameters["key_file"].value == "run/store.duckdb.key"  # the caller's, untouched


def _train(root: Path, task_runner: str, address: str | None = None) -> dict:
    # Not a skip: CI must run these (make setup-dev installs the extra).
    module = f"prefect_{task_runner}"
    assert importlib.util.find_spec(module), f"{module} missing: pip install -e '.[cluster]'"
    state = train(
        agent="tests.flow_agents:agent",
        tasks="tests.flow_agents:load_tasks",
        iterations=1,
        run_dir=str(root / "runs"),
        run_name=task_runner,
        registry=RegistryConfig(
            tracking_uri=f"sqlite:///{root}/mlflow.db", registered_model=f"cluster-{task_runner}"
        ),
        return_state=True,
        server={"model": "tiny"},
        rollouts={
            "tasks_per_iteration": TASKS,
            "group_size": GROUP,
            "sampling": {"temperature": 1.0},
            "rollout_workers": 2,
            "rollout_concurrency": 2,
            "task_runner": task_runner,
            "task_runner_address": address,
        },
        evaluation={"eval_size": 2, "eval_every": 1},
    )
    assert state.is_completed(), state.message
    return state.result()


def _worker_pids(run: Path, mode: str) -> set[int]:
    """The PIDs in the worker ids of the attempts at the run's rollouts of `mode`."""
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT DISTINCT a.worker_id FROM attempt_log a JOIN rollout_log r USING (rollout_id) "
            "WHERE r.mode = ?",
            [mode],
        ).fetchall()
    # runner-<hostname>-<pid>-<n>: the hostname may hold '-', the last two fields never do.
    return {int(worker.rsplit("-", 2)[1]) for (worker,) in rows}


def _rollout_progress(run: Path) -> list[dict]:
    """The progress events run-rollouts' workers appended to the run folder."""
    events, _ = progress.read(run)
    return [e for e in events if e["stage"] == "rollout"]


def _assert_ran_on_cluster(summary: dict, run: Path) -> None:
    assert summary["iterations"] == 1
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        (transitions,) = con.execute("SELECT count(*) FROM transitions").fetchone()
        statuses = con.execute(
            "SELECT DISTINCT status FROM rollouts WHERE mode = 'train'"
        ).fetchall()
    assert transitions == TASKS * GROUP  # tasks x G, one LLM call each
    assert statuses == [("succeeded",)]
    cluster = _worker_pids(run, "train")
    assert cluster and os.getpid() not in cluster, cluster
    assert _worker_pids(run, "test") == {os.getpid()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rollouts_run_on_a_local_dask_cluster(prefect_harness, tmp_path):
    # No address: the DaskTaskRunner starts a LocalCluster of worker processes and closes it.
    summary = _train(tmp_path, "dask")
    run = tmp_path / "runs" / "dask"
    _assert_ran_on_cluster(summary, run)
    # A local cluster shares this machine's run folder: its workers report each attempt.
    assert len(_rollout_progress(run)) == TASKS * GROUP


@pytest.fixture
def ray_head():
    """A one-node Ray cluster started as its own process, as on a cluster machine; the flow
    connects to it by address (task_runner_address), the multi-machine path."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert ray is not None, "the cluster extra is not installed (pip install -e '.[cluster]')"
    port = free_port()
    # Ray's socket paths must stay under the 107 bytes of AF_UNIX: a short folder, not tmp_path.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "LIGHTNING_API_KEY": KEY}
    # --block: the head's processes end with this one (no `ray stop`, which would end every
    # Ray process on the machine).
    head = subprocess.Popen(
        [
            ray, "start", "--head", "--block",
            f"--port={port}", "--node-ip-address=127.0.0.1",
            "--num-cpus=2", "--include-dashboard=false",
            f"--object-store-memory={100 * 2**20}",
            f"--temp-dir={temp}",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_for_port(port, head)
        yield f"127.0.0.1:{port}"
    finally:
        # Ctrl-C: `ray start --block` stops the node's processes and exits (in ~2 s; SIGTERM
        # leaves it waiting). Then whatever of its session is left, if anything, is killed.
        head.send_signal(signal.SIGINT)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass  # a loaded machine: its session is killed below
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)
            head.wait()
            shutil.rmtree(temp, ignore_errors=True)


def _wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"ray start exited with {process.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"the Ray head did not listen on {port} in {timeout_s} s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rollouts_run_on_a_ray_cluster_by_address(prefect_harness, ray_head, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # The policy server takes this key; the Ray workers have it from their node's environment.
    monkeypatch.setenv("LIGHTNING_API_KEY", KEY)
    summary = _train(tmp_path, "ray", ray_head)
    run = tmp_path / "runs" / "ray"
    _assert_ran_on_cluster(summary, run)
    # A cluster by address may be elsewhere: its workers get no run folder to report into.
    assert _rollout_progress(run) == []
