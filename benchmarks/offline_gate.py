"""One epoch of offline training (`train-offline`, method auto): the behaviour gap measured by a
forward pass of its own before the update, against the gap taken from the update's own forward
pass (`LoRATrainer.gated_step`), on one batch shaped like a week of the drift demo.

Batch: `--episodes` episodes of the calc agent's shape, two calls each, the second call's prompt
the first call's prompt + response + a tool result (prefix-merged into one row): first prompt
190 tokens, tool result 18, responses 17 (the drift demo's week 1: 139 episodes, 281 calls,
207 prompt and 17 response tokens a call). Random ids, seeded; recorded logprobs -0.5 a token.
Both ways start from the same adapter; the update is accepted either way, so both do the same
optimizer step (their updated adapters are compared: `max_abs_diff`).

    python benchmarks/offline_gate.py
    python benchmarks/offline_gate.py --quick   # the tiny random model, 4 episodes (the tests)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from lightning_core.algo.config import TrainerConfig  # noqa: E402
from lightning_core.algo.trainer import LoRATrainer  # noqa: E402
from lightning_core.models import tiny_model_dir  # noqa: E402
from lightning_core.types import Transition  # noqa: E402

PROMPT, TOOL, RESPONSE = 190, 18, 17


def batch(episodes: int, vocab: int, seed: int = 0) -> list[Transition]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    out = []
    for e in range(episodes):
        first, answer = ids(PROMPT), ids(RESPONSE)
        second = [*first, *answer, *ids(TOOL)]
        for step, prompt in enumerate((first, second)):
            response = answer if step == 0 else ids(RESPONSE)
            out.append(
                Transition(
                    rollout_id=f"ep-{e}",
                    step=step,
                    agent_name="calc",
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_logprobs=[-0.5] * len(response),
                    advantage=0.5 if e % 2 else -0.5,
                )
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=139)
    parser.add_argument("--quick", action="store_true", help="tiny random model, 4 episodes")
    args = parser.parse_args(argv)
    model = str(tiny_model_dir()) if args.quick else None
    episodes = 4 if args.quick else args.episodes
    config = TrainerConfig(model=model, learning_rate=2e-4)

    first = LoRATrainer(config)
    transitions = batch(episodes, first.model.config.vocab_size)
    tokens = sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in transitions)
    started = time.perf_counter()
    gap = first.behaviour_gap(transitions)
    measured = time.perf_counter() - started
    first.step(transitions)
    apart = time.perf_counter() - started

    gated = LoRATrainer(config)
    started = time.perf_counter()
    found, _ = gated.gated_step(transitions, lambda g: True)
    together = time.perf_counter() - started
    diff = max(
        float((p - first.lora_state()[n]).abs().max()) for n, p in gated.lora_state().items()
    )
    kl_diff = abs(found["offline/behaviour_kl"] - gap["offline/behaviour_kl"])

    print(f"batch: {len(transitions)} calls, {tokens} tokens, model {model or 'default'}")
    print("| epoch | gap pass s | update s | total s | behaviour_kl |")
    print("|---|---|---|---|---|")
    print(
        f"| gap first, then the update | {measured:.1f} | {apart - measured:.1f} | {apart:.1f} "
        f"| {gap['offline/behaviour_kl']:.4f} |"
    )
    kl = found["offline/behaviour_kl"]
    print(f"| gated update | - | {together:.1f} | {together:.1f} | {kl:.4f} |")
    record("offline_gate_time_saved_frac", f"{1 - together / apart:.2f}", save=not args.quick)
    print(f"behaviour_kl_abs_diff: {kl_diff:.2e}")
    print(f"max_abs_diff: {diff:.2e}")


if __name__ == "__main__":
    main()
