"""Structured outputs: what constrained decoding costs on the transformers backend.

8 concurrent requests (the gateway's clients, each one row of the continuous batch) on
SmolLM2-135M-Instruct, 64 new tokens each at T=0.8, once free and once under a JSON schema
(an object holding a list of at least 40 strings). The schema is long enough that no
constrained completion can end before its 64 tokens, and the prompt asks for a long text, so
both modes decode the same number of tokens at the same batch size and tokens/s compare the
per-token cost alone: the llguidance mask for each row (computed on the engine thread, between
the forward and the draw), the masking of the logits, and advancing each matcher. Rounds
alternate the two modes (a burst of load elsewhere hits both) and the table shows the median
of each.

    python benchmarks/structured.py [--rounds 5] [--clients 8] [--new-tokens 64]
    python benchmarks/structured.py --quick   # the same code in seconds (the tests run it)

Prints a table and the figure line `structured_overhead_pct: X` (goal <= 10). --quick: the tiny
random model (SmolLM2's tokenizer, so the same grammar work per token), 1 round of 2 requests x
16 new tokens; its figure says nothing of the real model's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from lightning_core.backends.base import (  # noqa: E402
    Constraint,
    GenerationRequest,
    SamplingParams,
)
from lightning_core.gateway.chat import encode, render_chat  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "sentences": {"type": "array", "items": {"type": "string"}, "minItems": 40},
    },
    "required": ["sentences"],
    "additionalProperties": False,
}
PROMPT = "Write a long story about a lighthouse keeper, as JSON: a list of its sentences."


async def _round(backend, prompt: list[int], clients: int, tokens: int, constrained: bool):
    constraint = Constraint(kind="json_schema", json_schema=SCHEMA) if constrained else None
    requests = [
        GenerationRequest(
            prompt_token_ids=prompt,
            params=SamplingParams(
                max_new_tokens=tokens, temperature=0.8, seed=i, constraint=constraint
            ),
        )
        for i in range(clients)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*(backend.generate(r) for r in requests))
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for choices in results for c in choices)
    finishes = sorted({c.finish_reason for choices in results for c in choices})
    return generated / seconds, generated, finishes


async def _measure(
    rounds: int, clients: int, tokens: int, model: str | None = None
) -> dict[str, list]:
    from lightning_core.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend(model=model)
    try:
        prompt = encode(
            backend.tokenizer,
            render_chat(backend.tokenizer, [{"role": "user", "content": PROMPT}]),
        )
        # Warm-up: the first forward and the first grammar compile are not the steady state.
        await _round(backend, prompt, clients, 8, False)
        await _round(backend, prompt, clients, 8, True)
        runs: dict[str, list] = {"free": [], "json_schema": []}
        for _ in range(rounds):
            for mode in runs:
                runs[mode].append(
                    await _round(backend, prompt, clients, tokens, mode == "json_schema")
                )
        return runs
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round of 2 x 16")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.clients, args.new_tokens = "tiny", 1, 2, 16
    runs = asyncio.run(_measure(args.rounds, args.clients, args.new_tokens, args.model))
    model = args.model or "SmolLM2-135M-Instruct"
    print(f"\ntransformers backend, {model}, {os.cpu_count()} cores, "
          f"{args.clients} concurrent requests x {args.new_tokens} new tokens, T=0.8, "
          f"median of {args.rounds} alternating rounds\n")  # fmt: skip
    print("| decoding | tok/s (median) | tok/s (min-max) | tokens a round | finish reasons |")
    print("|---|---|---|---|---|")
    medians = {}
    for mode, results in runs.items():
        speeds = [r[0] for r in results]
        medians[mode] = statistics.median(speeds)
        finishes = sorted({f for r in results for f in r[2]})
        print(
            f"| {mode} | {medians[mode]:.1f} | {min(speeds):.1f}-{max(speeds):.1f} | "
            f"{statistics.median(r[1] for r in results):.0f} | {', '.join(finishes)} |"
        )
    overhead = (medians["free"] / medians["json_schema"] - 1) * 100
    print()
    record("structured_overhead_pct", f"{overhead:.1f}", save=not args.quick)


if __name__ == "__main__":
    main()
