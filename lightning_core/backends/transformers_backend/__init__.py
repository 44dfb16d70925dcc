"""A policy backend on plain transformers + PEFT: continuous batching over a KV cache we manage,
LoRA adapters mixed in one batch, per-request sampling with logprobs, grammar-constrained
decoding.

One engine thread owns the model (`engine`): it admits requests, prefills their prompts into
the running batch and decodes one token for every row per step (`batch`, over the right-aligned
KV cache and the cache of shared prompt prefixes in `kv_cache`). Rows of different LoRA adapters
(and of the base model) share a forward through PEFT's `adapter_names=` mixed-batch path
(`adapters`). Each row samples by its own request's rules (`sampling`), with stop strings found
in its incrementally decoded text (`backends.text`). `backend` is the async facade.

Works with full-attention decoder models whose attention layers call `cache.update` (Llama,
SmolLM, Qwen2, Mistral without a sliding window). On CPU the linear layers run on prepacked
oneDNN weights (`packed_linear`).
"""

from lightning_core.backends.transformers_backend.backend import TransformersBackend
from lightning_core.backends.transformers_backend.config import TransformersBackendConfig

__all__ = ["TransformersBackend", "TransformersBackendConfig"]
