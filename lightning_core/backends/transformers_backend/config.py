"""How the transformers backend serves: model, device, batch limits, caches."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class TransformersBackendConfig(BaseModel):
    """How to serve the policy with transformers + PEFT in this process."""

    model: str | None = Field(
        None,
        description="Model folder or hub id; None serves SmolLM2-135M-Instruct, 'tiny' the "
        "tiny random test model.",
    )
    served_model_name: str | None = Field(
        None, description="Name requests use for the base model; None: from `model`."
    )
    device: str | None = Field(
        None, description="torch device ('cpu', 'cuda', 'cuda:1'); None: CUDA when available."
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="None: float32 on CPU (logprobs a trainer reproduces), bfloat16 on CUDA.",
    )
    max_batch_size: int = Field(
        64, ge=1, description="Most sequences decoded together; more requests wait for a row."
    )
    max_prefill_tokens: int = Field(
        4096,
        ge=1,
        description="Most prompt tokens (padding included) prefilled in one forward: bounds the "
        "pause running sequences see when new ones join.",
    )
    cache_chunk: int = Field(
        256, ge=1, description="KV cache columns allocated ahead, so most steps copy nothing."
    )
    threads: int | None = Field(
        None, ge=1, description="torch threads of the engine; None keeps torch's (one per core)."
    )
    prefix_cache_entries: int = Field(
        8,
        ge=0,
        description="Prompt prefixes whose keys and values are kept for reuse (0: none). Agent "
        "prompts share long prefixes (system prompt, tools, examples); prefilling only what "
        "follows them cuts most of the prefill compute.",
    )
    min_prefix_tokens: int = Field(
        16, ge=1, description="Shortest shared prefix worth a separate forward."
    )
    pack_weights: bool = Field(
        True,
        description="On CPU, keep linear weights prepacked for oneDNN: about 2x faster decoding "
        "than MKL's sgemm at small batches, for a second copy of the weights.",
    )
