"""The policy server of a training run: store + OpenAI-compatible gateway + backend.

It runs as a child process (`lightning-rl serve`): inference then has its own interpreter and
cores' worth of threads, apart from the agents and the trainer in the flow's process, and every
rollout task (threads here, Ray or Dask workers elsewhere) reaches it the same way, over HTTP.

It always requires an API key, even on loopback, where any local user could otherwise drive
the store and the policy. Tasks find the key in a 0600 file beside the store file, whose path
they are given: a Prefect parameter is stored and shown in the UI, so the key is never one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lightning_core.errors import StoreUnavailable
from lightning_core.security.keys import bearer_header
from lightning_core.serving import process as serving
from lightning_core.serving.config import ServerConfig, serve_options
from lightning_core.store.client import HttpStoreClient


@dataclass(frozen=True)
class PolicyServer:
    """A running server: where to reach it, the name its base model is served under, and the
    file holding its API key."""

    url: str
    base_model: str
    log_path: str
    key_file: str
    # The fingerprint of the tokenizer and chat template it renders with (docs/provenance.md), as
    # it reported it when it started; None from a server that does not report one.
    template_fingerprint: str | None = None
    # Restarts it if it dies (serving.Supervised); None for a server nobody supervises.
    supervised: serving.Supervised | None = field(default=None, repr=False, compare=False)

    @property
    def restarts(self) -> int:
        """Times the server was restarted after it died."""
        return self.supervised.restarts if self.supervised is not None else 0


def write_key_file(path: Path, key: str) -> None:
    # Created with mode 0600, so the key is never readable by others, not even for a moment;
    # fchmod for a file left by an earlier run, whose mode O_CREAT keeps.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.encode())
    finally:
        os.close(fd)


def read_key(key_file: str | None) -> str | None:
    """The key in `key_file`; None (no file named) leaves clients to LIGHTNING_API_KEY."""
    if key_file is None:
        return None
    try:
        return Path(key_file).read_text().strip()
    except OSError as exc:
        raise StoreUnavailable(
            f"cannot read the policy server's key file {key_file}: {exc}. The server that wrote "
            "it has stopped, or this worker does not share the run folder; set "
            "LIGHTNING_API_KEY on both instead"
        ) from exc


def store_client(server_url: str, key_file: str | None = None) -> HttpStoreClient:
    """A client of the policy server at `server_url`, with the key from `key_file`."""
    return HttpStoreClient(server_url, api_key=read_key(key_file))


@contextlib.contextmanager
def policy_server(
    db: Path,
    server: ServerConfig | None = None,
    *,
    tool_format: str = "auto",
    start_timeout_s: float = 900.0,
    max_restarts: int = serving.MAX_RESTARTS,
    env: dict[str, str] | None = None,
) -> Iterator[PolicyServer]:
    """Start the server `server` describes (default: the base model on transformers, on
    loopback) on a free port and stop it (cleanly) on the way out. Its key is the user's
    LIGHTNING_API_KEY when set (external runners may share it), else a fresh one. `env` adds to
    the server's environment (this process's, which it inherits).

    A server that dies meanwhile (killed, out of memory) is started again on the same store
    file, port and key, up to `max_restarts` times; past that, leaving raises StoreUnavailable
    with why it died."""
    key = os.environ.get("LIGHTNING_API_KEY") or secrets.token_urlsafe(32)
    key_file = Path(f"{db}.key")
    server = server or ServerConfig()
    host = server.host
    port = serving.free_port(host)
    options, secrets_env = serve_options(server)
    options += ["--tool-format", tool_format]
    write_key_file(key_file, key)
    try:
        # The first start on a fresh machine converts the default model (about 20 s) and, for
        # vLLM, may build its environment: minutes, hence the generous timeout.
        supervised = serving.Supervised(
            lambda: serving.start_serve(
                db,
                port,
                *options,
                timeout=start_timeout_s,
                preexec_fn=serving.die_with_parent,
                env={**os.environ, **(env or {}), **secrets_env, "LIGHTNING_API_KEY": key},
            ),
            max_restarts,
        )
        try:
            url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
            models = urllib.request.Request(f"{url}/v1/models", headers=bearer_header(key))
            with urllib.request.urlopen(models, timeout=30) as response:
                base_model = json.load(response)["data"][0]["id"]
            details = urllib.request.Request(f"{url}/health/details", headers=bearer_header(key))
            with urllib.request.urlopen(details, timeout=30) as response:
                fingerprint = json.load(response).get("template_fingerprint")
            yield PolicyServer(
                url=url,
                base_model=base_model,
                template_fingerprint=fingerprint,
                log_path=str(supervised.log_path),
                key_file=str(key_file),
                supervised=supervised,
            )
        except BaseException as exc:
            if supervised.failure is not None:
                # The flow failed with a store it could not reach; this is why.
                raise StoreUnavailable(supervised.failure) from exc
            raise
        finally:
            supervised.stop()
    finally:
        # The key is good only while this server runs; a restarted run makes a new one.
        key_file.unlink(missing_ok=True)
