"""The policy server of a training run: store + OpenAI-compatible gateway + backend.

It runs as a child process (`lightning-rl serve`): inference then has its own interpreter and
cores' worth of threads, apart from the agents and the trainer in the flow's process, and every
rollout task (threads here, Ray or Dask workers elsewhere) reaches it the same way, over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_core import serving


@dataclass(frozen=True)
class PolicyServer:
    """A running server: where to reach it and the name its base model is served under."""

    url: str
    base_model: str
    log_path: str


@contextlib.contextmanager
def policy_server(
    db: Path,
    *,
    host: str = "127.0.0.1",
    backend: str = "transformers",
    model: str | None = None,
    tool_format: str = "auto",
    vllm_url: str | None = None,
    start_timeout_s: float = 900.0,
) -> Iterator[PolicyServer]:
    """Start the server on a free port and stop it (cleanly) on the way out."""
    port = serving.free_port(host)
    options = ["--host", host, "--backend", backend, "--tool-format", tool_format]
    if model:
        options += ["--model", model]
    if vllm_url:
        options += ["--vllm-url", vllm_url]
    # The first start on a fresh machine converts the default model (about 20 s) and, for
    # vLLM, may build its environment: minutes, hence the generous timeout.
    proc = serving.start_serve(
        db, port, *options, timeout=start_timeout_s, preexec_fn=serving.die_with_parent
    )
    try:
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            base_model = json.load(response)["data"][0]["id"]
        yield PolicyServer(url=url, base_model=base_model, log_path=str(proc.log_path))
    finally:
        serving.stop_serve(proc)
