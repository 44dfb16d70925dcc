"""Policy backends: token ids in, token ids and logprobs out (transformers on CPU/GPU, vLLM)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from lightning_core.backends.base import Backend
from lightning_core.errors import InvalidInput

BackendKind = Literal["transformers", "vllm", "none"]
C = TypeVar("C", bound=BaseModel)


def create_backend(
    kind: BackendKind,
    model: str | None = None,
    vllm_url: str | None = None,
    vllm_python: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Backend | None:
    """The backend `lightning-rl serve` runs; "none" serves the store alone.

    `options` are more fields of the backend's own config (TransformersBackendConfig or
    VLLMBackendConfig: batch limits, device, dtype, caches, server flags), passed through and
    validated there; a name the config does not have is refused rather than ignored. `model`,
    `vllm_url` and `vllm_python`, when given, win over the same fields in `options`.

    The vLLM backend needs `await backend.start()` (the server app does it at start-up).
    """
    if kind == "none":
        return None
    given = {"model": model}
    if kind == "transformers":
        from lightning_core.backends.transformers_backend import (
            TransformersBackend,
            TransformersBackendConfig,
        )

        config = _config(TransformersBackendConfig, kind, options, given)
        return TransformersBackend(config)
    from lightning_core.backends.vllm_backend import VLLMBackend, VLLMBackendConfig

    config = _config(
        VLLMBackendConfig, kind, options, {**given, "url": vllm_url, "python": vllm_python}
    )
    return VLLMBackend(config)


def _config(cls: type[C], kind: str, options: Mapping[str, Any] | None, given: dict[str, Any]) -> C:
    options = dict(options or {})
    unknown = sorted(set(options) - set(cls.model_fields))
    if unknown:
        raise InvalidInput(
            f"the {kind} backend has no option {', '.join(map(repr, unknown))}; "
            f"it has {', '.join(cls.model_fields)}"
        )
    return cls.model_validate({**options, **{k: v for k, v in given.items() if v is not None}})
