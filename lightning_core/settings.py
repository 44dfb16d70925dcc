"""Settings read at the edges (CLI, server) from flags and `LIGHTNING_*` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from lightning_core.errors import InvalidInput
from lightning_core.gateway.service import GatewayConfig
from lightning_core.serving.config import ServerConfig
from lightning_core.serving.http_edge import HttpLimits, is_loopback
from lightning_core.store.config import StoreConfig

M = TypeVar("M", bound=BaseModel)


# What the server serves (ServerConfig, which the training flow's server shares), the store's
# and the gateway's settings are their own models, inherited whole: their fields (host, model,
# db, attempt_timeout_s, tool_format, ...) with their defaults, constraints and descriptions
# are ServeSettings fields, read as flags and LIGHTNING_<NAME> like the server's own.
class ServeSettings(ServerConfig, StoreConfig, GatewayConfig, HttpLimits, BaseSettings):
    """How `lightning-rl serve` runs; every field can be set as LIGHTNING_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="LIGHTNING_", extra="ignore")

    port: int = Field(4747, ge=0, le=65535, description="TCP port (0 picks a free one).")
    api_key: SecretStr | None = Field(
        None, description="Bearer token clients must send; required off loopback."
    )
    max_request_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted (64 MiB holds ~10k spans of 5 KB).",
    )
    log_level: str = Field("warning", description="uvicorn log level.")
    malloc_arenas: int = Field(
        2,
        ge=0,
        description="Most glibc malloc arenas of the server process; fewer arenas hold less "
        "memory freed by one thread and never reused by another (0: glibc's default, 8 per core).",
    )

    def store_config(self) -> StoreConfig:
        return self._part(StoreConfig)

    def gateway_config(self) -> GatewayConfig:
        config = self._part(GatewayConfig)
        # The store's folder holds what the runs serving from it write there: a training run's
        # adapters/ and warm_start/ (the champion it downloads), an evaluation's adapter/,
        # production's adapters/. So adapters load from there, and from what the operator adds.
        if self.db != ":memory:":
            store_folder = str(Path(self.db).expanduser().resolve().parent)
            config.adapter_roots = [store_folder, *config.adapter_roots]
        return config

    def http_limits(self) -> HttpLimits:
        return self._part(HttpLimits)

    def _part(self, model: type[M]) -> M:
        return model.model_validate(self.model_dump(include=set(model.model_fields)))

    def check_exposure(self) -> None:
        """Refuse to serve the store unauthenticated to anything but this machine."""
        if self.api_key is not None and self.api_key.get_secret_value():
            return
        if not is_loopback(self.host):
            raise InvalidInput(
                f"refusing to listen on {self.host} without an API key: anyone who can reach it "
                "could read and write the store. Set LIGHTNING_API_KEY, or bind to 127.0.0.1."
            )
