"""One LoRA update of SmolLM2-135M on a fixed batch: tokens/s, peak memory, and model FLOP
utilisation against this machine's measured dense matmul speed in the same dtype.

Batch: 32 transitions x 256 tokens (128 prompt + 128 response), random ids, seeded. The update
is the trainer's own `step` (micro-batches of `--micro-batch-tokens`, accumulation, clipping,
AdamW), timed after one warm-up step.

MFU = achieved model FLOP/s / measured matmul FLOP/s, with model FLOPs per token = 4 * N for LoRA
on a frozen base (forward 2N, backward through the activations 2N; the frozen weights get no
gradient and the adapter's own FLOPs are negligible), 6 * N with gradient checkpointing (one
more forward). N counts every parameter of the base model, embeddings included (SmolLM2 ties
them with the output layer, which does run once per token).

Then prefix merging (docs/lightningrl.md): a synthetic multi-turn batch, 8 episodes of 4
calls of one agent, each call's prompt the previous call's prompt + response + a 32-token tool
result (first prompt 128 tokens, responses 32), trained with `prefix_merge` on and off from
the same adapter: the tokens the forward passes cover and the seconds per step of each, and
`prefix_merge_tokens_saved_frac` and `prefix_merge_step_speedup`.

    python benchmarks/train_step.py
    python benchmarks/train_step.py --quick   # the same code in seconds (the tests run it)

--quick: the tiny random model, 4 transitions x 64 tokens, one timed step, the matmul speed
measured on 512 x 512 matrices, and 2 episodes of 3 calls for prefix merging; its figures say
nothing of SmolLM2's.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.results import record  # noqa: E402
from lightning_core.algo.config import TrainerConfig  # noqa: E402
from lightning_core.algo.trainer import LoRATrainer  # noqa: E402
from lightning_core.types import Transition  # noqa: E402


def matmul_flops(
    dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 10
) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def batch(rows: int, prompt: int, response: int, vocab: int) -> list[Transition]:
    g = torch.Generator().manual_seed(0)
    return [
        Transition(
            rollout_id=f"ro-{i}",
            step=0,
            prompt_token_ids=torch.randint(3, vocab, (prompt,), generator=g).tolist(),
            response_token_ids=torch.randint(3, vocab, (response,), generator=g).tolist(),
            response_logprobs=[-5.0] * response,
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(rows)
    ]


def multi_turn_batch(
    episodes: int, calls: int, prompt: int, response: int, observation: int, vocab: int
) -> list[Transition]:
    """Episodes of `calls` calls of one agent, each prompt extending the previous call's prompt
    + response by an `observation` (a tool result): what prefix merging shares."""
    g = torch.Generator().manual_seed(1)
    out = []
    for e in range(episodes):
        context = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        for step in range(calls):
            answer = torch.randint(3, vocab, (response,), generator=g).tolist()
            out.append(
                Transition(
                    rollout_id=f"ep-{e}",
                    step=step,
                    prompt_token_ids=context,
                    response_token_ids=answer,
                    response_logprobs=[-5.0] * response,
                    advantage=1.0 if e % 2 else -1.0,
                )
            )
            context = (
                context + answer + torch.randint(3, vocab, (observation,), generator=g).tolist()
            )
    return out


def seconds_per_step(trainer: LoRATrainer, data: list[Transition], steps: int) -> float:
    """Mean seconds of `steps` updates (after a warm-up, which the caller runs)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.step(data)
    return (time.perf_counter() - t0) / steps


def prefix_merging(args: argparse.Namespace, episodes: int, calls: int) -> None:
    """Merged vs separate forward passes on one multi-turn batch."""
    rows = []
    for merge in (False, True):
        # Shared prefixes off in both arms: unmerged, an episode's rows begin with the same
        # first prompt, which sharing would compute once (benchmarks/shared_prefix.py).
        trainer = LoRATrainer(
            TrainerConfig(
                model=args.model,
                micro_batch_tokens=args.micro_batch_tokens,
                prefix_merge=merge,
                prefix_share=False,
            )
        )
        vocab = trainer.model.get_base_model().config.vocab_size
        data = multi_turn_batch(episodes, calls, 128, 32, 32, vocab)
        forward = sum(
            len(r[-1].prompt_token_ids) + len(r[-1].response_token_ids)
            for r in trainer._rows(data, merge)
        )
        trainer.step(data)  # warm-up
        rows.append((merge, forward, seconds_per_step(trainer, data, args.steps)))
    (_, apart, slow), (_, merged, fast) = rows
    print()
    print(f"prefix merging: {episodes} episodes x {calls} calls of one agent")
    print("| prefix_merge | forward tokens | seconds/step |")
    print("|---|---|---|")
    for merge, forward, seconds in rows:
        print(f"| {str(merge).lower()} | {forward} | {seconds:.2f} |")
    save, variant = not args.quick, _variant(args)
    record(
        "prefix_merge_tokens_saved_frac", f"{1 - merged / apart:.3f}", variant=variant, save=save
    )
    record("prefix_merge_step_speedup", f"{slow / fast:.2f}", variant=variant, save=save)


def _variant(args: argparse.Namespace) -> str | None:
    """What sets this run's figures apart from the default run's (another model, 6 N)."""
    parts = [f"model {args.model}"] if args.model else []
    parts += ["checkpointing"] if args.checkpointing else []
    return ", ".join(parts) or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n matmul")
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 x 64 tokens, 1 step")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.rows, args.tokens, args.steps, args.matmul_size = "tiny", 4, 64, 1, 512

    trainer = LoRATrainer(
        TrainerConfig(
            model=args.model,
            micro_batch_tokens=args.micro_batch_tokens,
            gradient_checkpointing=args.checkpointing,
        )
    )
    n_params = sum(p.numel() for p in trainer.model.get_base_model().parameters())
    vocab = trainer.model.get_base_model().config.vocab_size
    data = batch(args.rows, args.tokens // 2, args.tokens - args.tokens // 2, vocab)
    tokens = args.rows * args.tokens
    print(f"model {n_params / 1e6:.1f}M params, {trainer.dtype}, {trainer.device}", flush=True)

    trainer.step(data)  # warm-up: allocator, oneDNN kernels, optimizer state
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = seconds_per_step(trainer, data, args.steps)
    if trainer.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
        peak_what = "GPU memory"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        peak_what = "process RSS"

    peak_flops = matmul_flops(trainer.dtype, trainer.device, args.matmul_size)
    per_token = (6 if args.checkpointing else 4) * n_params
    achieved = per_token * tokens / seconds
    mfu = achieved / peak_flops
    print()
    print(
        "| batch | seconds/step | tokens/s | peak memory | model TFLOP/s | matmul TFLOP/s | MFU |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.rows} x {args.tokens} | {seconds:.1f} | {tokens / seconds:.0f} | "
        f"{peak:.1f} GiB ({peak_what}) | {achieved / 1e12:.3f} | {peak_flops / 1e12:.3f} | "
        f"{100 * mfu:.1f} % |"
    )
    formula = "6*N" if args.checkpointing else "4*N"
    print(f"MFU = {formula} x tokens/s / matmul FLOP/s, N = {n_params} (base model, frozen)")
    record("train_mfu", f"{mfu:.3f}", variant=_variant(args), save=not args.quick)
    prefix_merging(args, *((2, 3) if args.quick else (8, 4)))


if __name__ == "__main__":
    main()
