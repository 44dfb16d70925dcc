"""The vLLM backend: a policy served by vLLM's OpenAI server, spoken to in token ids.

Either launches `python -m vllm.entrypoints.openai.api_server` (from its own environment, see
`vllm_env`) on loopback and owns it, or attaches to a server already running. Every request goes
to `/v1/completions` with the prompt as token ids (the gateway already applied the chat template)
and asks for `return_token_ids` and logprobs with `return_tokens_as_token_ids`, so ids and
logprobs come back exactly as sampled, never re-tokenized text.

vLLM's own output is post-processed to the stopping rules of `base.py`: eos and stop tokens are
already in its `token_ids`, but after a stop string it keeps the token that completed the string,
so the ids are cut before the token in which the stop string begins; a stream holds back tokens
that could be the start of a stop string until it is clear they are not.

Logprobs: the launched server runs with `--logprobs-mode processed_logprobs`, so a logprob is
under the distribution sampled from (after temperature). vLLM applies top-p before it computes
them, so with top_p < 1 they are renormalized over the nucleus. An attached server reports what
its own `--logprobs-mode` says (vLLM's default: before temperature).

LoRA adapters are loaded at run time (`/v1/load_lora_adapter`). vLLM keys its prefix cache on
(adapter name, path), so reloading new weights from the same folder under the same name would
reuse KV blocks computed with the old weights; when the server shares this machine's filesystem,
each load therefore serves a private snapshot of the folder from a path of its own.

Structured outputs: a request's constraint goes to vLLM as its `structured_outputs` field
(`completions`); vLLM masks the logits with the grammar before it samples and computes logprobs.

Modules: `config` (settings, VLLMUnavailable), `server` (the launched process), `completions`
(the request body and the choices parsed back), `backend` (VLLMBackend).
"""

from __future__ import annotations

from lightning_core.backends.vllm_backend.backend import VLLMBackend
from lightning_core.backends.vllm_backend.config import VLLMBackendConfig, VLLMUnavailable

__all__ = ["VLLMBackend", "VLLMBackendConfig", "VLLMUnavailable"]
