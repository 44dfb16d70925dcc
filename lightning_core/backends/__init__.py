"""Policy backends: token ids in, token ids and logprobs out (transformers on CPU/GPU, vLLM), one
or several replicas behind one router (replicas.py)."""

from __future__ import annotations

import os
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
    replicas: int = 1,
) -> Backend | None:
    """The backend `lightning-rl serve` runs; "none" serves the store alone.

    `options` are more fields of the backend's own config (TransformersBackendConfig or
    VLLMBackendConfig: batch limits, device, dtype, caches, server flags), passed through and
    validated there; a name the config does not have is refused rather than ignored. `model`,
    `vllm_url` and `vllm_python`, when given, win over the same fields in `options`.

    `replicas` > 1 serves the policy from that many backends behind one ReplicatedBackend:
    transformers replicas in processes of their own (remote.launch_replicas), or vLLM servers,
    launched or attached to (`vllm_url` then lists one URL per replica, comma-separated).
    Each replica gets the same `options`.

    The vLLM backend needs `await backend.start()` (the server app does it at start-up).
    """
    if kind == "none":
        return None
    if replicas < 1:
        raise InvalidInput(f"replicas must be at least 1, got {replicas}")
    urls = [u.strip() for u in vllm_url.split(",") if u.strip()] if vllm_url else []
    if kind == "vllm" and len(urls) > 1:
        if replicas not in (1, len(urls)):
            raise InvalidInput(
                f"--vllm-url lists {len(urls)} servers but --replicas is {replicas}; give one "
                "URL per replica"
            )
        replicas = len(urls)
    if replicas == 1:
        return _single(kind, model, vllm_url, vllm_python, options)
    from lightning_core.backends.replicas import ReplicatedBackend

    if kind == "transformers":
        from lightning_core.backends.remote import launch_replicas
        from lightning_core.backends.transformers_backend import TransformersBackendConfig

        # Checked here, before any process starts, so that a bad option fails in one line.
        _config(TransformersBackendConfig, kind, options, {"model": model})
        return ReplicatedBackend(launch_replicas(replicas, model, _shared_cores(options, replicas)))
    if len(urls) == 1:
        raise InvalidInput(
            f"--replicas {replicas} with --vllm-url attaches to {replicas} vLLM servers: give "
            "their URLs comma-separated, or no URL to launch them"
        )
    port = (options or {}).get("port")
    return ReplicatedBackend(
        [
            _single(
                kind,
                model,
                urls[i] if urls else None,
                vllm_python,
                # Launched servers on ports of their own: the next ones after a given port.
                {**(options or {}), "port": port + i} if port and not urls else options,
            )
            for i in range(replicas)
        ]
    )


def _single(
    kind: BackendKind,
    model: str | None,
    vllm_url: str | None,
    vllm_python: str | None,
    options: Mapping[str, Any] | None,
) -> Backend:
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


def _shared_cores(options: Mapping[str, Any] | None, replicas: int) -> dict[str, Any]:
    """Replica options with the machine's cores split between them, unless `threads` is set:
    torch's default (a thread per core) in every replica would oversubscribe the CPU."""
    options = dict(options or {})
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    options.setdefault("threads", max(1, (cores or 1) // replicas))
    return options


def _config(cls: type[C], kind: str, options: Mapping[str, Any] | None, given: dict[str, Any]) -> C:
    options = dict(options or {})
    unknown = sorted(set(options) - set(cls.model_fields))
    if unknown:
        raise InvalidInput(
            f"the {kind} backend has no option {', '.join(map(repr, unknown))}; "
            f"it has {', '.join(cls.model_fields)}"
        )
    return cls.model_validate({**options, **{k: v for k, v in given.items() if v is not None}})
