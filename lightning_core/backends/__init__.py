"""Policy backends: token ids in, token ids and logprobs out (transformers on CPU/GPU, vLLM)."""

from __future__ import annotations

from typing import Literal

from lightning_core.backends.base import Backend

BackendKind = Literal["transformers", "vllm", "none"]


def create_backend(
    kind: BackendKind,
    model: str | None = None,
    vllm_url: str | None = None,
    vllm_python: str | None = None,
) -> Backend | None:
    """The backend `lightning-rl serve` runs; "none" serves the store alone.

    The vLLM backend needs `await backend.start()` (the server app does it at start-up).
    """
    if kind == "none":
        return None
    if kind == "transformers":
        from lightning_core.backends.transformers_backend import TransformersBackend

        return TransformersBackend(model=model)
    from lightning_core.backends.vllm_backend import VLLMBackend

    return VLLMBackend(model=model, url=vllm_url, python=vllm_python)
