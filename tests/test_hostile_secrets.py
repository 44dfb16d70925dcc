"""Issue 43, part 6: secrets never in params, flow-run parameters or command lines, and a reload
webhook that neither replays nor starves.

- vLLM's key given in the backend options (a plain dict on its way to the server) is not in the
  MLflow params (a real SQLite MLflow), the Prefect parameters, the run folder's saved config or
  the policy server's log; the real policy server gets it by its environment, never its command
  line, and uses it (a loopback vLLM stand-in sees it). A masked record read back is refused
  with what to do, and `api_key_env` names a variable instead of holding a key.
- `production --live` refuses `webhook_secret` on the command line, naming the environment
  variable and the file that take it.
- The reload webhook (real loopback HTTP): a replayed MLflow delivery is answered as already seen
  and does nothing; slow connections that send nothing hold no thread and keep no signed
  delivery out; a request trickled byte by byte is cut at its whole-request deadline.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi import FastAPI, Request
from mlflow import MlflowClient
from pydantic import ValidationError
from typer.testing import CliRunner

from lightning_core.backends.transformers_backend import TransformersBackendConfig
from lightning_core.backends.vllm_backend.config import VLLMBackendConfig
from lightning_core.backends.vllm_backend.server import VLLMServer
from lightning_core.models import tiny_model_dir
from lightning_core.security.redaction import MASKS
from lightning_core.serving.config import SECRET_OPTIONS, ServerConfig, serve_options
from lightning_rl.flows.cli import app
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.run_state import CONFIG_FILE, save_config
from lightning_rl.policy_server import policy_server
from lightning_rl.registry import webhook
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.live_config import LiveConfig
from lightning_rl.registry.runs import log_params, tracking
from lightning_rl.registry.webhook import MLFLOW_PATH, Deliveries, ReloadHook, mlflow_signature
from tests.conftest import ThreadedServer

KEY = "sk-vllm-hostile-Qp4w"
SECRET = "webhook-secret-hostile-Zr8"


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    monkeypatch.delenv("LIGHTNING_API_KEY", raising=False)
    monkeypatch.delenv("LIGHTNING_BACKEND_OPTIONS", raising=False)
    monkeypatch.delenv("LIGHTNING_LIVE_WEBHOOK_SECRET", raising=False)


def _vllm_config(**server: Any) -> TrainConfig:
    options = {"api_key": KEY, "max_model_len": 4096}
    return TrainConfig(server={"backend": "vllm", "backend_options": options, **server})


# ---------------------------------------------------------------------------- vLLM's key


def test_the_vllm_key_is_in_no_mlflow_param_and_no_saved_config(tmp_path):
    """Finding: `server.backend_options.api_key` was logged as an MLflow param in clear: backend
    options are a dict, which the backend config's SecretStr does not type."""
    registry = RegistryConfig(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    config = _vllm_config()
    with tracking(registry, run_name="vllm-key") as run:
        # What a run logs at its start (flows/run_start.py), and a dict no config validated.
        log_params(config.model_dump(mode="json"), run_id=run.info.run_id)
        log_params({"raw": {"backend_options": {"api_key": KEY}}}, run_id=run.info.run_id)
    params = MlflowClient(registry.tracking_uri).get_run(run.info.run_id).data.params
    assert not [name for name, value in params.items() if KEY in value]
    assert params["server.backend_options.api_key"] in MASKS
    assert params["raw.backend_options.api_key"] in MASKS
    assert params["server.backend_options.max_model_len"] == "4096"  # the rest still readable
    # Every secret field of a backend's config is one the server config holds as a secret.
    for model in (VLLMBackendConfig, TransformersBackendConfig):
        secrets = {n for n, f in model.model_fields.items() if "SecretStr" in str(f.annotation)}
        assert secrets <= SECRET_OPTIONS, model
    # The run folder's config, which a resumed run reads back.
    save_config(tmp_path, config.model_dump(mode="json", exclude={"run_dir"}))
    assert KEY not in (tmp_path / CONFIG_FILE).read_text()
    # The config as a log line shows it.
    assert KEY not in f"{config} {config!r} {config.server}"


def test_prefect_records_no_vllm_key():
    """Finding: the same dict travelled in the Prefect flow-run parameters (the train flow's
    `server`, the subflows' `config`), which Prefect records and shows."""
    from lightning_rl.flows.batch_source import rollout_batch
    from lightning_rl.flows.iteration import train_iteration
    from lightning_rl.flows.train import train

    config = _vllm_config()
    recorded = [
        train.serialize_parameters(config.model_dump()),
        train_iteration.serialize_parameters({"config": config, "iteration": 1}),
        rollout_batch.serialize_parameters({"config": config, "iteration": 1}),
    ]
    for parameters in recorded:
        assert KEY not in json.dumps(parameters)
    assert recorded[1]["config"]["server"]["backend_options"]["api_key"] in MASKS
    assert recorded[1]["config"]["server"]["backend_options"]["max_model_len"] == 4096


def test_the_policy_server_gets_the_key_by_environment_never_its_command_line(tmp_path):
    """Finding: `serve_options` put the backend options, key and all, on the policy server's
    command line (`--backend-options '{"api_key": ...}'`), which every local user can read."""
    seen: list[str] = []
    stand_in = FastAPI()

    @stand_in.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        seen.append(request.headers.get("authorization", ""))
        return {"object": "list", "data": [{"id": tiny_model_dir().name, "object": "model"}]}

    with ThreadedServer(stand_in) as vllm:
        server = _vllm_config(model=str(tiny_model_dir()), vllm_url=vllm.url).server
        options, env = serve_options(server)
        assert KEY not in " ".join(options) and KEY in env["LIGHTNING_BACKEND_OPTIONS"]
        with policy_server(tmp_path / "store.duckdb", server, start_timeout_s=300) as running:
            children = psutil.Process().children(recursive=True)
            [serve] = [p for p in children if "serve" in p.cmdline()]
            for child in children:
                assert KEY not in " ".join(child.cmdline())
            assert KEY in serve.environ()["LIGHTNING_BACKEND_OPTIONS"]
            log = Path(running.log_path)
        # The server attached with the key it got from its environment.
        assert seen and set(seen) == {f"Bearer {KEY}"}
    assert KEY not in log.read_text()


def test_a_masked_key_read_back_is_refused_and_a_variable_can_hold_the_key(monkeypatch, tmp_path):
    """What is recorded is a mask, so a deployment run (Prefect hands it the recorded
    parameters) or a resumed run (its saved config) reads back a mask: refused, saying what to
    do. `api_key_env` names the variable instead, and reads it when the key is needed."""
    recorded = _vllm_config().model_dump(mode="json")["server"]["backend_options"]
    for mask in MASKS:
        with pytest.raises(ValidationError, match=r"the record of a key.*api_key_env"):
            VLLMBackendConfig(**{**recorded, "api_key": mask})
    monkeypatch.setenv("VLLM_KEY_FOR_TEST", KEY)
    config = VLLMBackendConfig(api_key_env="VLLM_KEY_FOR_TEST")
    assert config.secret_key() == KEY and KEY not in config.model_dump_json()
    # A launched server requires that key (VLLM_API_KEY in its environment), on any interface.
    exposed = config.model_copy(update={"host": "0.0.0.0"})
    launched = VLLMServer(exposed, tmp_path, "m", tmp_path)
    launched._check_exposure()
    assert launched.api_key == KEY
    server = ServerConfig(backend="vllm", backend_options={"api_key_env": "VLLM_KEY_FOR_TEST"})
    assert KEY not in json.dumps(serve_options(server))
    with pytest.raises(ValidationError, match="not both"):
        VLLMBackendConfig(api_key=KEY, api_key_env="VLLM_KEY_FOR_TEST")
    monkeypatch.delenv("VLLM_KEY_FOR_TEST")
    with pytest.raises(ValidationError, match="VLLM_KEY_FOR_TEST, which is not set"):
        VLLMBackendConfig(api_key_env="VLLM_KEY_FOR_TEST")


# ---------------------------------------------------------------------------- webhook secret


def test_live_json_on_the_command_line_refuses_the_webhook_secret(tmp_path, monkeypatch):
    """Finding: `production --live '{"webhook_secret": ...}'` took the secret on the command
    line. It is refused, and the message says where it goes instead."""
    done = CliRunner().invoke(app, ["production", "--live", json.dumps({"webhook_secret": SECRET})])
    assert done.exit_code == 2, done.output
    assert "--live does not take webhook_secret" in done.output
    assert "LIGHTNING_LIVE_WEBHOOK_SECRET" in done.output and "webhook_secret_file" in done.output
    assert SECRET not in done.output and "Traceback" not in done.output
    # Where it goes instead: the environment, or a file.
    monkeypatch.setenv("LIGHTNING_LIVE_WEBHOOK_SECRET", SECRET)
    assert LiveConfig().webhook_secret.get_secret_value() == SECRET
    monkeypatch.delenv("LIGHTNING_LIVE_WEBHOOK_SECRET")
    path = tmp_path / "webhook.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    assert LiveConfig(webhook_secret_file=str(path)).webhook_secret.get_secret_value() == SECRET
    with pytest.raises(ValidationError, match="not both"):
        LiveConfig(webhook_secret="x", webhook_secret_file=str(path))
    with pytest.raises(ValidationError, match="cannot read webhook_secret_file"):
        LiveConfig(webhook_secret_file=str(tmp_path / "missing"))


# ---------------------------------------------------------------------------- reload webhook


def _delivery(delivery_id: str | None = None) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"entity": "model_version_alias", "data": {"name": "m"}}).encode()
    delivery = delivery_id or uuid.uuid4().hex
    now = str(int(time.time()))
    return body, {
        "X-MLflow-Signature": mlflow_signature(SECRET, delivery, now, body),
        "X-MLflow-Timestamp": now,
        "X-MLflow-Delivery-Id": delivery,
    }


@pytest.fixture
def hook():
    nudged: list[float] = []
    running = ReloadHook("127.0.0.1", 0, SECRET, "m", lambda: nudged.append(time.time())).start()
    running.nudged = nudged
    try:
        yield running
    finally:
        running.close()


def test_a_replayed_delivery_is_answered_already_seen_and_does_nothing(hook):
    """Finding: a captured delivery could be sent again, and counted again, for the 300 s its
    timestamp stays fresh."""
    body, headers = _delivery()
    first = httpx.post(hook.url + MLFLOW_PATH, content=body, headers=headers)
    assert first.status_code == 200 and first.json() == {"status": "ok"}
    assert len(hook.nudged) == 1
    replayed = httpx.post(hook.url + MLFLOW_PATH, content=body, headers=headers)
    assert replayed.status_code == 200 and replayed.json() == {"status": "already seen"}
    assert len(hook.nudged) == 1
    # The next delivery, a new id, counts.
    body, headers = _delivery()
    assert httpx.post(hook.url + MLFLOW_PATH, content=body, headers=headers).status_code == 200
    assert len(hook.nudged) == 2
    # An id is remembered while its timestamp is fresh, and forgotten after (then the clock
    # refuses a replay); a forged delivery with a taken id is refused by its signature first.
    deliveries, now = Deliveries(), time.time()
    stamp = str(int(now))
    assert deliveries.first("d", stamp, now) and not deliveries.first("d", stamp, now + 299)
    assert deliveries.first("d", stamp, now + webhook.MAX_SKEW_S + 2)


def test_slow_connections_hold_no_thread_and_keep_no_signed_delivery_out(hook):
    """Finding: eight connections that sent a head and then trickled their bodies held all
    eight handler slots (the next delivery was answered 503), each in a thread of its own."""
    threads = threading.active_count()
    host, port = hook.url.removeprefix("http://").split(":")
    slow = []
    try:
        for _ in range(webhook.MAX_CONNECTIONS + 16):
            connection = socket.create_connection((host, int(port)))
            connection.sendall(b"POST /hooks/mlflow HTTP/1.1\r\nContent-Length: 1000\r\n\r\nx")
            slow.append(connection)
        time.sleep(0.5)
        assert threading.active_count() == threads  # the hook's one thread serves them all
        started = time.monotonic()
        body, headers = _delivery()
        answer = httpx.post(hook.url + MLFLOW_PATH, content=body, headers=headers, timeout=5)
        assert answer.status_code == 200 and answer.json() == {"status": "ok"}, answer.text
        assert len(hook.nudged) == 1 and time.monotonic() - started < 2
    finally:
        for connection in slow:
            connection.close()


def test_a_request_trickled_byte_by_byte_is_cut_at_its_whole_request_deadline(monkeypatch):
    """Finding: the deadline was per read (10 s between bytes), so a client sending a byte
    every few seconds held its handler as long as it liked."""
    monkeypatch.setattr(webhook, "REQUEST_DEADLINE_S", 1.0)
    running = ReloadHook("127.0.0.1", 0, SECRET, "m", lambda: None).start()
    host, port = running.url.removeprefix("http://").split(":")
    request = b"POST /hooks/mlflow HTTP/1.1\r\nX-Padding: " + b"a" * 200
    answer = b""
    started = time.monotonic()
    try:
        with socket.create_connection((host, int(port))) as connection:
            for byte in request:  # a byte every 50 ms: each read is quick, the request is not
                try:
                    connection.sendall(bytes([byte]))
                except OSError:
                    break
                if select.select([connection], [], [], 0.05)[0]:
                    answer = connection.recv(4096)
                    break
        elapsed = time.monotonic() - started
    finally:
        running.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert 0.9 < elapsed < 3.0
