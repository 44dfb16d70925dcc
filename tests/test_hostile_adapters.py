"""Adapters and trainer state from outside the run (issue 25, items 4 and 5).

A policy version's `adapter_path` is chosen by whoever publishes it, and a champion's files by
whoever registers a model version; neither may make the server reach the Hub, read a folder
outside the allowed roots, unpickle anything, or spend seconds and memory on a crafted config.
The vLLM child is reachable by any local process, so it asks for a key only its owner knows.

Publishing goes to a real `lightning-rl serve --model tiny` on loopback; the champion is
registered in a real MLflow SQLite registry; vLLM cannot run here, so its launch is checked
against a stand-in server that speaks vLLM's command line, key rule and adapter routes.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

import httpx
import pytest

from lightning_core.serving.process import free_port, start_serve

# --- a real server, its store in a folder that holds the run's adapters ------------------------


def _save_adapter(folder: Path, **lora: object) -> Path:
    """A real PEFT LoRA folder of the tiny model (safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_core.models import tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    options = {"r": 2, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    get_peft_model(model, LoraConfig(**{**options, **lora})).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def run_root(tmp_path_factory, good_adapter) -> Path:
    root = tmp_path_factory.mktemp("run")
    shutil.copytree(good_adapter, root / "adapters" / "v1")
    return root


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory) -> Path:
    return _save_adapter(tmp_path_factory.mktemp("good") / "adapter")


@pytest.fixture(scope="module")
def outside(tmp_path_factory, good_adapter) -> Path:
    """A good adapter in a folder that is not among the server's roots."""
    folder = tmp_path_factory.mktemp("elsewhere") / "adapter"
    shutil.copytree(good_adapter, folder)
    return folder


@pytest.fixture(scope="module")
def server(run_root):
    """`lightning-rl serve --model tiny` with its store in the run folder (the allowed root)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    proc = start_serve(run_root / "store.duckdb", port, "--model", "tiny", env=env, timeout=300)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def _publish(url: str, name: str, adapter_path: str) -> httpx.Response:
    version = {"name": name, "base_model": "tiny", "adapter_path": adapter_path}
    return httpx.post(f"{url}/store/policy-versions", json=version, timeout=120)


def _refused(response: httpx.Response, *words: str) -> str:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


def _variant(run_root: Path, name: str, **config: object) -> Path:
    """A copy of the good adapter inside the run folder, its adapter_config.json changed."""
    folder = run_root / "adapters" / name
    shutil.copytree(run_root / "adapters" / "v1", folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def test_an_adapter_under_the_run_folder_is_served(server, run_root):
    """Control: the run's own adapter, published as a training run does, loads and serves."""
    import openai

    assert _publish(server, "good-v1", str(run_root / "adapters" / "v1")).status_code == 200
    api = openai.OpenAI(base_url=f"{server}/v1", api_key="-", max_retries=0)
    assert "good-v1" in [m.id for m in api.models.list().data]
    answer = api.chat.completions.create(
        model="good-v1", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.usage.completion_tokens <= 3


def test_a_hub_style_adapter_id_is_refused_in_under_a_second(server):
    """Finding: a hub-style id made the server retry the Hub for 23 s, every generation
    waiting behind it. Now a path that is not a local folder never reaches PEFT."""
    started = time.monotonic()
    response = _publish(server, "hub-v1", "HuggingFaceTB/some-lora")
    elapsed = time.monotonic() - started
    _refused(response, "local")
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_an_absolute_path_outside_the_roots_is_refused(server, outside):
    """Finding: any absolute path loaded. A good adapter outside the allowed roots is refused,
    and the message says how to allow its folder."""
    _refused(_publish(server, "outside-v1", str(outside)), "outside", "LIGHTNING_ADAPTER_ROOTS")


def test_a_symlinked_folder_out_of_the_roots_is_refused(server, run_root, outside):
    """Finding: a symlinked folder loaded. A link inside the run folder to an adapter outside
    it, and a link to an outside weights file inside an adapter folder, are both refused."""
    link = run_root / "adapters" / "linked"
    link.symlink_to(outside, target_is_directory=True)
    _refused(_publish(server, "linked-v1", str(link)), "outside")

    mixed = run_root / "adapters" / "mixed"
    mixed.mkdir()
    shutil.copy(outside / "adapter_config.json", mixed)
    (mixed / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    _refused(_publish(server, "mixed-v1", str(mixed)), "link", "outside")


def test_a_pickle_only_adapter_is_refused(server, run_root):
    """Finding: weights as adapter_model.bin are a pickle; with no safetensors file PEFT would
    torch.load it. Refused before anything reads it."""
    import torch
    from safetensors.torch import load_file

    folder = run_root / "adapters" / "pickled"
    folder.mkdir()
    shutil.copy(run_root / "adapters" / "v1" / "adapter_config.json", folder)
    weights = load_file(run_root / "adapters" / "v1" / "adapter_model.safetensors")
    torch.save(weights, folder / "adapter_model.bin")
    _refused(_publish(server, "pickled-v1", str(folder)), "adapter_model.safetensors", "pickle")


def test_a_huge_rank_or_a_pattern_of_target_modules_is_refused(server, run_root):
    """Finding: a config's huge `r` or regex `target_modules` cost seconds or hundreds of MB.
    Each is refused with a 400 that names the field, before PEFT builds anything."""
    huge = _variant(run_root, "huge-r", r=100_000)
    _refused(_publish(server, "huge-v1", str(huge)), "r is 100000", "LIGHTNING_MAX_ADAPTER_RANK")

    pattern = _variant(run_root, "pattern", target_modules=r".*(q|v)_proj")
    _refused(_publish(server, "pattern-v1", str(pattern)), "target_modules", "pattern")

    many = _variant(run_root, "many", target_modules=[f"m{i}" for i in range(500)])
    _refused(_publish(server, "many-v1", str(many)), "target_modules", "500")

    absent = _variant(run_root, "absent", target_modules=["q_proj", "no_such_proj"])
    _refused(_publish(server, "absent-v1", str(absent)), "no_such_proj")
    # None of them was registered or left loaded.
    names = [v["name"] for v in httpx.get(f"{server}/store/policy-versions").json()]
    assert not {"huge-v1", "pattern-v1", "many-v1", "absent-v1"} & set(names)


# --- code execution through the registry -------------------------------------------------------


class _Planted:
    """Unpickling this creates `marker`: what an attacker's trainer_state.pt would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _register_as_attacker(config, folder: Path) -> str:
    """Register `folder` as a new version of the model and make it champion, with MLflow's own
    client, as anyone with write access to the registry can."""
    from mlflow import MlflowClient

    from lightning_rl.registry.connection import experiment_id
    from lightning_rl.registry.pyfunc import ADAPTER_ARTIFACT

    client = MlflowClient(config.tracking_uri, registry_uri=config.tracking_uri)
    run = client.create_run(experiment_id(client, config))
    client.log_artifacts(run.info.run_id, str(folder), f"policy/artifacts/{ADAPTER_ARTIFACT}")
    client.set_terminated(run.info.run_id)
    client.create_registered_model(config.registered_model)
    source = f"{run.info.artifact_uri}/policy"
    version = client.create_model_version(config.registered_model, source, run.info.run_id)
    client.set_registered_model_alias(config.registered_model, "champion", version.version)
    return str(version.version)


def test_a_malicious_trainer_state_in_the_champion_is_refused(tmp_path, monkeypatch, good_adapter):
    """Finding: trainer_state.pt was loaded with weights_only=False, so a champion registered
    with a crafted one ran its code in the training flow that warm-started from it. The
    warm-started trainer now refuses it with a clear error, and nothing ran."""
    import mlflow
    import torch

    from lightning_core.algo.config import TrainerConfig
    from lightning_core.algo.trainer import STATE_FILE, LoRATrainer
    from lightning_core.errors import InvalidInput
    from lightning_rl.registry.config import RegistryConfig
    from lightning_rl.registry.versions import champion_adapter

    database = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{database}")
    mlflow.set_registry_uri(f"sqlite:///{database}")
    config = RegistryConfig(tracking_uri=f"sqlite:///{database}", registered_model="hostile")

    crafted = tmp_path / "crafted"
    shutil.copytree(good_adapter, crafted)
    marker = tmp_path / "code-ran"
    state = {"optimizer": _Planted(str(marker)), "version": 1, "rng": torch.get_rng_state()}
    torch.save(state, crafted / STATE_FILE)
    pickle.loads(pickle.dumps(_Planted(str(tmp_path / "probe")))).close()
    assert (tmp_path / "probe").exists()  # the payload is live: unpickling it runs it

    version = _register_as_attacker(config, crafted)
    # What a warm_start=champion run does: download the champion into the run folder, then
    # train from it (tasks/training.py builds LoRATrainer(config, adapter=previous)).
    found = champion_adapter(config, "champion", dst=tmp_path / "run" / "warm_start")
    assert found is not None and found.version == version
    assert (found.adapter / STATE_FILE).is_file()
    with pytest.raises(InvalidInput, match="trainer state") as refused:
        LoRATrainer(TrainerConfig(model="tiny"), adapter=found.adapter)
    assert STATE_FILE in str(refused.value)
    assert not marker.exists(), "the planted trainer state ran its code"


# --- the vLLM child ---------------------------------------------------------------------------

# vLLM's OpenAI server as far as the backend uses it: its flags, its key rule (VLLM_API_KEY
# asks every /v1 request for `Bearer <key>`; /health stays open) and the adapter routes.
_STANDIN = """
import argparse, json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name")
parser.add_argument("--api-key")
args, _ = parser.parse_known_args()
key = args.api_key or os.environ.get("VLLM_API_KEY")
adapters = {}


class Handler(BaseHTTPRequestHandler):
    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _allowed(self):
        if not self.path.startswith("/v1") or not key:
            return True
        if self.headers.get("Authorization") == "Bearer " + key:
            return True
        self._answer(401, {"error": "Unauthorized"})
        return False

    def do_GET(self):
        if not self._allowed():
            return
        if self.path == "/health":
            return self._answer(200, {})
        models = [{"id": args.served_model_name}]
        parent = args.served_model_name
        models += [{"id": n, "root": p, "parent": parent} for n, p in adapters.items()]
        self._answer(200, {"object": "list", "data": models})

    def do_POST(self):
        if not self._allowed():
            return
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/v1/load_lora_adapter":
            adapters[body["lora_name"]] = body["lora_path"]
        elif self.path == "/v1/unload_lora_adapter":
            adapters.pop(body["lora_name"], None)
        self._answer(200, {})

    def log_message(self, *a):
        pass


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


def _standin_python(folder: Path) -> Path:
    """An interpreter on which `python -m vllm.entrypoints.openai.api_server` is the stand-in
    (the backend removes PYTHONPATH from the server's environment, so a wrapper sets it)."""
    package = folder / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for init in (folder / "vllm", folder / "vllm" / "entrypoints", package):
        (init / "__init__.py").write_text("")
    (package / "api_server.py").write_text(_STANDIN)
    wrapper = folder / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={folder} exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


async def test_the_launched_vllm_server_asks_for_a_key_on_loopback(tmp_path, good_adapter):
    """Finding: the vLLM child had no key, so any local process could call it past the
    gateway's key and limits, and load adapters at run time. Now each launch has a key of its
    own, in the server's environment (not its command line); the backend sends it; a call
    without it is refused; and the server binds loopback."""
    from lightning_core.backends.vllm_backend import VLLMBackend
    from lightning_core.errors import InvalidInput

    python = _standin_python(tmp_path / "standin")
    async with VLLMBackend(model="tiny", python=str(python)) as backend:
        pid = backend.server_pid
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        keys = [e.split(b"=", 1)[1] for e in environment if e.startswith(b"VLLM_API_KEY=")]
        assert len(keys) == 1 and len(keys[0]) >= 32
        assert not any(keys[0] in arg for arg in command)
        assert b"--api-key" not in command
        assert command[command.index(b"--host") + 1] == b"127.0.0.1"

        # Anyone else on the machine: refused, to read or to load an adapter.
        assert httpx.get(f"{backend.url}/v1/models").status_code == 401
        sneaked = {"lora_name": "x", "lora_path": str(tmp_path)}
        assert httpx.post(f"{backend.url}/v1/load_lora_adapter", json=sneaked).status_code == 401
        # The backend itself: its key on every call.
        await backend.load_adapter("policy-v1", str(good_adapter))
        assert backend.adapters() == ["policy-v1"]
        # A client given the key (an attached backend) gets in; one without it does not.
        async with VLLMBackend(model="tiny", url=backend.url, api_key=backend.server_key) as other:
            assert other.adapters() == ["policy-v1"]
        with pytest.raises(InvalidInput, match="Unauthorized"):
            await VLLMBackend(model="tiny", url=backend.url).start()

    # Another interface needs a key of the operator's choosing.
    with pytest.raises(InvalidInput, match="api_key"):
        await VLLMBackend(model="tiny", python=str(python), host="0.0.0.0").start()
