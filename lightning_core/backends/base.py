"""The interface every policy backend implements, in token ids: the gateway does the rest.

The gateway applies the chat template, tokenizes, and decodes; a backend only turns prompt token
ids into completion token ids with their logprobs. That is what keeps the recorded ids exact:
they are the ids the backend consumed and produced, never text tokenized again.

Stopping rules, the same for every backend:
- An end-of-sequence token (the tokenizer's eos, or any of `stop_token_ids`) ends a completion
  with finish_reason "stop" and IS included in `token_ids`: the policy chose to stop, and
  training must see that choice. (Decoding with skip_special_tokens drops it from the text.)
- A stop string ends it with finish_reason "stop"; `token_ids` are cut before the token in
  which the stop string begins, so decoding them never shows any of it.
- `max_new_tokens` ends it with finish_reason "length".
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from lightning_core.errors import InvalidInput

FinishReason = Literal["stop", "length"]


class Constraint(BaseModel):
    """Output restricted to a grammar (structured outputs), enforced token by token.

    The logprobs a backend reports for a constrained completion are those of the distribution
    it actually sampled from: the model's, with every token the grammar forbids masked out and
    the rest renormalised. That is the behaviour policy, so the trainer's importance ratios
    stay right.
    """

    kind: Literal["json_object", "json_schema", "grammar"] = Field(
        description="json_object: any JSON object; json_schema: JSON valid for `json_schema`; "
        "grammar: text in the language of `grammar`."
    )
    json_schema: dict[str, Any] | None = Field(
        None, description="The JSON schema (kind json_schema only)."
    )
    grammar: str | None = Field(
        None,
        description="A Lark grammar in llguidance's dialect, the one vLLM's `structured_outputs` "
        "grammar takes (kind grammar only).",
    )


class SamplingParams(BaseModel):
    """How to sample one completion."""

    max_new_tokens: int = Field(256, ge=1, description="Upper bound on generated tokens.")
    temperature: float = Field(1.0, ge=0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int | None = Field(None, description="Makes sampling reproducible for one request.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (see module doc).")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Extra end-of-sequence token ids, beside eos."
    )
    top_logprobs: int = Field(
        0, ge=0, le=20, description="Alternatives to report per position (0: none)."
    )
    constraint: Constraint | None = Field(
        None, description="Grammar the completion must follow (structured outputs); None: free."
    )


class GenerationRequest(BaseModel):
    prompt_token_ids: list[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    n: int = Field(1, ge=1, le=64, description="Independent completions of the same prompt.")
    adapter: str | None = Field(None, description="LoRA adapter name; None for the base model.")
    affinity: str | None = Field(
        None,
        description="Routing hint: calls with the same key go to the same replica while it is "
        "not much busier than the least-loaded one (backends/replicas.py), where their shared "
        "prompt prefix is cached. Single backends ignore it.",
    )


class Choice(BaseModel):
    """One completion."""

    token_ids: list[int]
    # Log-probability of each generated token under the sampling policy (after temperature,
    # before top-p truncation): always returned, since the trainer needs them.
    logprobs: list[float]
    # Per position, the `top_logprobs` most likely (token id, logprob) pairs, if asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason
    # The stop string that ended it, when one did (its text is not in `token_ids`).
    stop_sequence: str | None = None


class StreamDelta(BaseModel):
    """Tokens of a streamed completion as they are decided; the last delta has finish_reason."""

    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None


def check_stream_request(request: GenerationRequest) -> None:
    """The refusal every backend's `stream` gives a request for several completions."""
    if request.n != 1:
        raise InvalidInput(
            f"stream() yields one completion, so n must be 1 (got {request.n}); stream with "
            "n=1, or use generate() for several"
        )


@runtime_checkable
class Backend(Protocol):
    """A policy served in token ids: a base model plus any number of named LoRA adapters."""

    #: Name of the base model, as the gateway lists it and requests select it.
    base_model: str
    #: The Hugging Face tokenizer of the base model (chat template included).
    tokenizer: Any

    def adapters(self) -> list[str]:
        """Names of the loaded LoRA adapters."""
        ...

    async def generate(self, request: GenerationRequest) -> list[Choice]:
        """`request.n` completions of the prompt."""
        ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """One completion, delta by delta; n != 1 raises InvalidInput (check_stream_request)."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter folder under `name` (replacing one of that name)."""
        ...

    async def unload_adapter(self, name: str) -> None: ...

    async def close(self) -> None: ...
