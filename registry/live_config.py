"""The settings of the production loop's live side: following the aliases, the canary and its
gate, automatic rollback. Plain pydantic-settings, without MLflow (LIGHTNING_LIVE_<FIELD>, nested
with `__`, e.g. LIGHTNING_LIVE_GATE__ALPHA=0.01), read by `lightning-rl production`."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lightning_core.stats.sequential import LiveGateConfig, RollbackConfig


class LiveConfig(BaseSettings):
    """How a production server follows the registry, runs canaries and rolls back."""

    model_config = SettingsConfigDict(
        env_prefix="LIGHTNING_LIVE_", env_nested_delimiter="__", extra="forbid"
    )

    follow: bool = Field(
        True,
        description="Follow the registered model's champion and challenger aliases: swap the "
        "served adapter when they move, without a restart. False: serve the starting version.",
    )
    poll_s: float = Field(
        10.0,
        gt=0,
        description="Seconds between looks at the registry; with a webhook (or a Prefect "
        "automation calling it) a look also follows each alias move at once, and polling is "
        "the backstop for a lost delivery. The live gate and rollback run at each look.",
    )
    canary_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Share of episodes (sticky per episode id) served by a challenger in canary.",
    )
    webhook_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the reload webhook on the server's host (0: any free port); None: "
        "no webhook, polling only. With an http(s) tracking server, `production` registers it "
        "as an MLflow webhook on model-version-alias events.",
    )
    webhook_url: str | None = Field(
        None,
        description="The URL MLflow should call, when it reaches this machine by another name "
        "than the bound address (a proxy, a container); None: http://HOST:PORT/hooks/mlflow.",
    )
    webhook_secret: SecretStr | None = Field(
        None,
        description="Shared secret signing webhook deliveries (MLflow's HMAC, or the "
        "X-Lightning-Reload-Secret header of a Prefect automation); None: a new random one "
        "per run (given to the MLflow webhook it registers). Set it as "
        "LIGHTNING_LIVE_WEBHOOK_SECRET or by webhook_secret_file: `--live` refuses it, since a "
        "command line is readable by every user of the machine.",
    )
    webhook_secret_file: str | None = Field(
        None,
        description="A file whose content (stripped) is webhook_secret: a file only the "
        "server's user can read (mode 0600), instead of the secret itself.",
    )
    gate: LiveGateConfig = Field(
        default_factory=LiveGateConfig, description="The live gate on the canary's feedback."
    )
    rollback: RollbackConfig = Field(
        default_factory=RollbackConfig, description="Automatic rollback of a failing champion."
    )

    @model_validator(mode="after")
    def _secret_from_its_file(self) -> LiveConfig:
        if self.webhook_secret_file is None:
            return self
        if self.webhook_secret is not None:
            raise ValueError("give webhook_secret or webhook_secret_file, not both")
        try:
            secret = Path(self.webhook_secret_file).expanduser().read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read webhook_secret_file: {exc}") from exc
        if not secret:
            raise ValueError(f"webhook_secret_file {self.webhook_secret_file} is empty")
        self.webhook_secret = SecretStr(secret)
        return self
