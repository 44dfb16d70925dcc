"""MLflow's tracking server unavailable at registration, for real: an `mlflow server` process on
loopback (SQLite backend, artifacts proxied through it) killed before or during the
`register-policy` task. Rows of the fault matrix (benchmarks/fault_matrix.py).

What must hold: the task retries and finishes when the server is back, or fails with
RegistryUnavailable saying what to do; never a version without its score, benchmark and
decision tags; the champion untouched until a decision moves it; and registering again (the
flow run resumed) finishes the registration without a second version.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from lightning_core.serving.process import free_port
from lightning_rl.registry import versions
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import RegistryUnavailable
from lightning_rl.registry.names import (
    CHALLENGER,
    CHAMPION,
    TAG_BENCHMARK_ID,
    TAG_BENCHMARK_SIZE,
    TAG_DECISION,
    TAG_SCORE,
)
from lightning_rl.registry.promotion import recorded_decision
from lightning_rl.registry.runs import tracking
from lightning_rl.registry.versions import register_policy_version
from lightning_rl.tasks import registry as registry_tasks
from lightning_rl.tasks.registry import register_policy
from tests.helpers import wait_healthy
from tests.test_registry import BENCH, make_adapter

MLFLOW = str(Path(sys.executable).parent / "mlflow")


class MlflowServer:
    """`mlflow server` on a loopback port, in a process group of its own: killed with SIGKILL,
    started again on the same port and database."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.env = env or {}
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300) -> None:
        log = (self.root / "server.log").open("ab")
        self.process = subprocess.Popen(
            [
                MLFLOW,
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination",
                str(self.root / "artifacts"),
                "--workers",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Its background job runner is for GenAI jobs the registry never starts.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.env},
        )
        try:
            wait_healthy(self.url, self.process, timeout, "mlflow server")
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {(self.root / 'server.log').read_text()[-3000:]}") from e

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    @property
    def up(self) -> bool:
        return self.process is not None and self.process.poll() is None


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[MlflowServer]:
    # One for the module: each start is 10-50 s on a busy machine.
    running = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    running.start()
    yield running
    running.kill()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("adapter"))


@pytest.fixture
def config(server, monkeypatch, request) -> Iterator[RegistryConfig]:
    if not server.up:
        server.start()
    # MLflow's client retries a refused connection 7 times over minutes; here an attempt fails
    # at once, and the task's retries (or their absence) decide.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    yield RegistryConfig(
        tracking_uri=server.url,
        registered_model="faults-" + request.node.name.translate(str.maketrans("[]", "--")),
        promotion_threshold=0.3,
    )
    if not server.up:
        server.start()  # for the next test


def _arguments(config: RegistryConfig, adapter: Path, run_id: str) -> tuple:
    # register-policy's parameters: policy version v2, iteration 2, score 0.9 on BENCH.
    return (config, str(adapter), "tiny", "v2", 2, 0.9, BENCH, 50, run_id)


def _register(config: RegistryConfig, adapter: Path, run_id: str, v: int, score: float):
    return register_policy_version(
        config,
        adapter,
        base_model="tiny",
        policy_version=f"v{v}",
        iteration=v,
        score=score,
        benchmark_id=BENCH,
        benchmark_size=50,
        run_id=run_id,
    )


def _champion_v1(config: RegistryConfig, adapter: Path, run_id: str) -> None:
    decision = _register(config, adapter, run_id, 1, 0.5)
    assert decision.promote and decision.challenger_version == "1"


def _registry(config: RegistryConfig) -> tuple[dict[str, dict[str, str]], str | None, list]:
    """Each version's tags, the champion's version, and the promotion lock's tickets."""
    client = MlflowClient(config.tracking_uri)
    name = config.registered_model
    found = client.search_model_versions(f"name = '{name}'")
    tags = {str(v.version): v.tags for v in found}
    champion = client.get_model_version_by_alias(name, CHAMPION)
    tickets = client.search_model_versions(f"name = '{name}.promotion-lock'")
    return tags, str(champion.version), tickets


def _whole(tags: dict[str, str]) -> bool:
    """Registered with everything a version must carry from its first moment."""
    return {TAG_SCORE, TAG_BENCHMARK_ID, TAG_BENCHMARK_SIZE, TAG_DECISION} <= tags.keys()


@pytest.mark.slow
@pytest.mark.fault(
    name="MLflow server down at registration",
    injected="the `mlflow server` process (SQLite backend) SIGKILLed before the register-policy "
    "task starts, started again while the task retries",
    outcome="the attempts while it is down fail with RegistryUnavailable; the retry after it is "
    "back registers one version with its score, benchmark and decision, and moves the champion",
)
def test_a_registration_while_the_server_is_down_finishes_when_it_is_back(
    server, config, adapter, monkeypatch
):
    attempts: list[BaseException | None] = []

    def counted(*args, **kwargs):
        try:
            decision = register_policy_version(*args, **kwargs)
        except BaseException as e:
            attempts.append(e)
            raise
        attempts.append(None)
        return decision

    monkeypatch.setattr(registry_tasks, "register_policy_version", counted)

    def restart_after_a_failed_attempt() -> None:
        while not attempts:
            time.sleep(0.05)
        server.start()

    with tracking(config) as run:
        _champion_v1(config, adapter, run.info.run_id)
        server.kill()
        restarter = threading.Thread(target=restart_after_a_failed_attempt, daemon=True)
        restarter.start()
        # The task's own 2 retries 10 s apart outlast a restart of a few seconds; this one may
        # take a minute on a busy machine, so more, shorter waits.
        task = register_policy.with_options(retries=150, retry_delay_seconds=2)
        decision = task(*_arguments(config, adapter, run.info.run_id))
        restarter.join(timeout=300)

    failed = [e for e in attempts if e is not None]
    assert failed and all(isinstance(e, RegistryUnavailable) for e in failed)
    assert "cannot be reached" in str(failed[0]) and server.url in str(failed[0])
    assert attempts[-1] is None and len(attempts) == len(failed) + 1
    assert decision.promote and (decision.challenger_version, decision.champion_version) == (
        "2",
        "1",
    )
    tags, champion, tickets = _registry(config)
    assert sorted(tags) == ["1", "2"] and all(_whole(t) for t in tags.values())
    assert recorded_decision("2", tags["2"]) == decision
    assert champion == "2" and tickets == []


def _kill_when(server: MlflowServer, monkeypatch, point: str) -> None:
    """SIGKILL the server as the registration reaches `point`, then let it go on."""
    real = getattr(versions, point)

    def killing(*args, **kwargs):
        server.kill()
        return real(*args, **kwargs)

    monkeypatch.setattr(versions, point, killing)


@pytest.mark.slow
@pytest.mark.fault(
    name="MLflow server killed mid-registration",
    injected="the `mlflow server` process SIGKILLed while register-policy uploads the adapter, "
    "or after it created the version and before the aliases move; it stays down for the "
    "task's retries",
    outcome="the task fails with RegistryUnavailable saying how to recover; no version without "
    "its score, benchmark and decision, the champion untouched; registering again once the "
    "server is back (the resumed flow) finishes it, with no second version",
)
@pytest.mark.parametrize("point", ["log_adapter_model", "_point_challenger"])
def test_a_registration_cut_off_by_the_server_fails_clearly_and_half_nothing(
    server, config, adapter, monkeypatch, point
):
    with tracking(config) as run:
        _champion_v1(config, adapter, run.info.run_id)
        with monkeypatch.context() as patch:
            _kill_when(server, patch, point)
            task = register_policy.with_options(retries=1, retry_delay_seconds=0.5)
            state = task(*_arguments(config, adapter, run.info.run_id), return_state=True)
        assert state.is_failed()
        with pytest.raises(RegistryUnavailable, match=r"cannot be reached .* Start it"):
            state.result()

        server.start()
        tags, champion, _ = _registry(config)
        # Killed before the version was created: none; after: one, whole, not yet champion.
        assert sorted(tags) == (["1"] if point == "log_adapter_model" else ["1", "2"])
        assert all(_whole(t) for t in tags.values())
        assert champion == "1"

        # The flow run resumed: the same run registers the same policy version again.
        decision = _register(config, adapter, run.info.run_id, 2, 0.9)
    assert decision.promote and decision.challenger_version == "2"
    tags, champion, tickets = _registry(config)
    assert sorted(tags) == ["1", "2"] and all(_whole(t) for t in tags.values())
    assert champion == "2" and tickets == []
    client = MlflowClient(config.tracking_uri)
    assert str(client.get_model_version_by_alias(config.registered_model, CHALLENGER).version) == (
        "2"
    )
