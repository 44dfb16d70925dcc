"""The `/v1/completions` wire format: a GenerationRequest as vLLM's request body, and vLLM's
choices back as token ids, logprobs and top alternatives."""

from __future__ import annotations

from typing import Any

from lightning_core.backends.base import Constraint, GenerationRequest
from lightning_core.backends.vllm_backend.config import VLLMUnavailable
from lightning_core.errors import InvalidInput


def request_body(request: GenerationRequest, model: str, stream: bool) -> dict[str, Any]:
    p = request.params
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "seed": p.seed,
        "n": request.n,
        "stop": p.stop,
        "stop_token_ids": p.stop_token_ids,
        # Sampling knobs the request does not name, pinned so that no server-side default
        # changes the policy the trainer believes was sampled.
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        # The sampled token plus the top alternatives; keys "token_id:N" (unambiguous,
        # where decoded strings of different ids can collide).
        "logprobs": p.top_logprobs,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "stream": stream,
    }
    if p.constraint is not None:
        body["structured_outputs"] = structured_outputs(p.constraint)
    return body


def structured_outputs(constraint: Constraint) -> dict[str, Any]:
    """vLLM's own `structured_outputs` request field (its StructuredOutputsParams) for a constraint.

    vLLM applies the grammar's bitmask to the logits in place in its model runner, before its
    sampler runs (GPUModelRunner.sample, which the CPU runner inherits); the sampler computes
    processed_logprobs from those masked logits after temperature, so the logprobs it returns
    are those of the masked, renormalised distribution sampled from, as base.Constraint asks.
    """
    if constraint.kind == "json_object":
        return {"json_object": True}
    if constraint.kind == "grammar":
        if not constraint.grammar:
            raise InvalidInput("a grammar constraint needs its grammar")
        return {"grammar": constraint.grammar}
    if constraint.json_schema is None:
        raise InvalidInput("a json_schema constraint needs its json_schema")
    return {"json": constraint.json_schema}


def parse_tokens(
    raw: dict[str, Any], top_k: int
) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """Token ids, their logprobs and the top alternatives of one choice (or stream delta)."""
    ids = [int(i) for i in raw.get("token_ids") or []]
    lp = raw.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    if [_token_id(t) for t in tokens] != ids:
        raise VLLMUnavailable("vLLM's logprobs do not line up with its token_ids")
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    top = None
    if top_k:
        # vLLM lists the sampled token first, then the top k; the sampled one is either among
        # them or one extra entry, so sorting and keeping k gives the true top k.
        top = [
            sorted(((_token_id(t), float(v)) for t, v in step.items()), key=lambda x: -x[1])[:top_k]
            for step in lp.get("top_logprobs") or []
        ]
    return ids, logprobs, top


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def finish_reason(raw: dict[str, Any]) -> Any:
    finish = raw.get("finish_reason")
    if finish not in ("stop", "length"):
        raise VLLMUnavailable(f"vLLM ended a completion with finish_reason {finish!r}")
    return finish


def stopped_on_string(raw: dict[str, Any]) -> bool:
    """vLLM stopped on a stop string (its stop_reason names it), not a token or the length."""
    return isinstance(raw.get("stop_reason"), str)
