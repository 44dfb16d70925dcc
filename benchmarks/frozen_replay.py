"""Epochs of offline training over the same batch (the drift demo's weekly retraining runs 4
iterations over a week's episodes), each one gated update (`LoRATrainer.gated_step`): every
forward pass whole, against keeping the frozen layers' output (below `lora.top_layers`) from
the first epoch and starting the later epochs' passes above them (algo/frozen.py).

Batch: benchmarks/offline_gate.py's (the drift demo's week 1: 139 episodes, 281 calls). Both
arms start from the same adapter and take the same steps; their adapters are compared after the
last epoch (`max_abs_diff`).

    python benchmarks/frozen_replay.py                # 4 epochs, SmolLM2-135M, top 12 layers
    python benchmarks/frozen_replay.py --quick        # the tiny random model (the tests)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.offline_gate import batch  # noqa: E402
from benchmarks.results import record  # noqa: E402
from lightning_core.algo.config import LoRAConfig, TrainerConfig  # noqa: E402
from lightning_core.algo.frozen import FrozenActivations  # noqa: E402
from lightning_core.algo.trainer import LoRATrainer  # noqa: E402
from lightning_core.models import tiny_model_dir  # noqa: E402


def epochs(trainer: LoRATrainer, transitions: list, n: int) -> list[float]:
    """Seconds of each of `n` gated updates over the same transitions."""
    seconds = []
    for _ in range(n):
        started = time.perf_counter()
        _, metrics = trainer.gated_step(transitions, lambda gap: True)
        assert metrics is not None
        seconds.append(time.perf_counter() - started)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=139)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny random model, 4 episodes")
    args = parser.parse_args(argv)
    model = str(tiny_model_dir()) if args.quick else None
    episodes = 4 if args.quick else args.episodes
    # The production demo's trainer: the adapter on the top 12 of the 30 layers (1 of 2 on the
    # tiny model).
    lora = LoRAConfig(top_layers=1 if args.quick else 12)
    # Shared prefixes off in both arms: a replay turns them off (its micro-batches are ordered
    # by length), and the whole passes compared with it sum their gradients in the same order.
    config = TrainerConfig(model=model, learning_rate=2e-4, lora=lora, prefix_share=False)

    whole = LoRATrainer(config)
    transitions = batch(episodes, whole.model.config.vocab_size)
    tokens = sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in transitions)
    whole_s = epochs(whole, transitions, args.epochs)
    replaying = LoRATrainer(config)
    replaying.frozen = FrozenActivations(4096)
    replay_s = epochs(replaying, transitions, args.epochs)
    theirs = whole.lora_state()
    diff = max(float((p - theirs[n]).abs().max()) for n, p in replaying.lora_state().items())

    print(f"batch: {len(transitions)} calls, {tokens} tokens, model {model or 'default'}")
    print(f"cache: {replaying.frozen.used / 2**20:.1f} MiB")
    print("| epoch | whole s | replayed s |")
    print("|---|---|---|")
    for i, (a, b) in enumerate(zip(whole_s, replay_s, strict=True), 1):
        print(f"| {i} | {a:.1f} | {b:.1f} |")
    print(f"| all | {sum(whole_s):.1f} | {sum(replay_s):.1f} |")
    later = sum(replay_s[1:]) / sum(whole_s[1:]) if args.epochs > 1 else 1.0
    record("frozen_replay_later_epoch_saved_frac", f"{1 - later:.2f}", save=not args.quick)
    saved = 1 - sum(replay_s) / sum(whole_s)
    record("frozen_replay_time_saved_frac", f"{saved:.2f}", save=not args.quick)
    print(f"max_abs_diff: {diff:.2e}")


if __name__ == "__main__":
    main()
