"""GPU readiness check: the transformers backend's decoding at 1, 8 and 64 concurrent requests
and one LoRA trainer step, on a randomly initialised model of Qwen2.5-1.5B's shape, with
tokens/s and model FLOP utilisation (MFU) against this card's measured bf16 matmul rate.

Needs only torch, transformers, peft and this repository: no network (HF_HUB_OFFLINE=1), no
downloaded weights, no vLLM. The model is built from benchmarks/configs/qwen2.5-1.5b.json with
random weights and saved to a temporary folder with a two-token tokenizer made here, so token ids
are random-model tokens (the figures measure compute, not text). About two minutes on an
H100/H200; `--dry-run` runs the same code on tiny shapes on the CPU in seconds (CI runs it).

MFU = model FLOP/s / matmul FLOP/s, N = every parameter of the base model (embeddings counted
once: Qwen2.5-1.5B ties them with the output layer, which runs once per token):
  decode: 2 * N per generated token (one forward), prefill time included in the wall time;
  train:  4 * N per token, LoRA on a frozen base as benchmarks/train_step.py counts it (forward
          2N + backward through the activations 2N; the frozen weights get no gradient). The
          usual full-fine-tuning estimate 6 * N would read 1.5x higher.

    python benchmarks/gpu_check.py            # CUDA, bf16, Qwen2.5-1.5B shape
    python benchmarks/gpu_check.py --dry-run  # CPU, float32, tiny shapes
"""

from __future__ import annotations

import os

# Before transformers is imported: nothing here may reach the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.results import record  # noqa: E402

CONFIG = ROOT / "benchmarks" / "configs" / "qwen2.5-1.5b.json"
CONCURRENCY = (1, 8, 64)
# --dry-run's model: Qwen2's architecture at toy size, so the same code paths run in seconds.
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
}


@dataclass
class Row:
    phase: str
    shape: str
    tokens: int
    seconds: float
    flops_per_token: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def tflops(self) -> float:
        return self.flops_per_token * self.tokens_per_s / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(dtype: torch.dtype, device: torch.device, n: int, repeats: int) -> float:
    """Dense matmul FLOP/s of this device in `dtype`: the MFU denominator."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):  # warm-up: cuBLAS heuristics, clocks
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def save_tokenizer(folder: Path) -> int:
    """A two-token tokenizer (end-of-text, unknown): the backend needs one to load, and only
    its eos and pad ids are used, since requests here are token ids. Returns the eos id."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
    )
    fast.save_pretrained(folder)
    return vocab["<|endoftext|>"]


def build_model(
    folder: Path, dry_run: bool, dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    """Save a random model of the config's shape (tiny with --dry-run) into `folder`; returns
    (parameters, vocab size)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    fields = json.loads(CONFIG.read_text())
    if dry_run:
        fields.update(TINY_SHAPE)
    eos = save_tokenizer(folder)
    fields.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    config = Qwen2Config(**{k: v for k, v in fields.items() if k != "torch_dtype"})
    torch.manual_seed(0)
    # Initialised on the device: filling 1.5B parameters on the CPU takes far longer.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return params, config.vocab_size


async def decode(
    folder: Path, args: argparse.Namespace, device: torch.device, dtype: str, n_params: int
) -> list[Row]:
    from lightning_core.backends.base import GenerationRequest, SamplingParams
    from lightning_core.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend(
        model=str(folder), device=str(device), dtype=dtype, max_batch_size=max(CONCURRENCY)
    )
    vocab = backend._engine.vocab
    g = torch.Generator().manual_seed(0)

    def request(i: int, new_tokens: int) -> GenerationRequest:
        # Distinct random prompts: a shared one would be served from the prefix cache.
        prompt = torch.randint(2, vocab, (args.prompt_tokens,), generator=g).tolist()
        return GenerationRequest(
            prompt_token_ids=prompt,
            params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=i),
        )

    rows = []
    try:
        # Warm-up at the largest batch: kernels, allocator, KV cache growth.
        await asyncio.gather(*(backend.generate(request(i, 4)) for i in range(max(CONCURRENCY))))
        for concurrency in CONCURRENCY:
            requests = [request(i, args.new_tokens) for i in range(concurrency)]
            sync(device)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(backend.generate(r) for r in requests))
            sync(device)
            seconds = time.perf_counter() - t0
            # A random model may sample eos early: count what was generated.
            tokens = sum(len(c.token_ids) for choices in results for c in choices)
            rows.append(Row("decode", f"{concurrency} concurrent", tokens, seconds, 2 * n_params))
            print(
                f"decode {concurrency:>2} concurrent: {tokens} tokens in {seconds:.2f} s",
                flush=True,
            )
    finally:
        await backend.close()
    return rows


def train_step(
    folder: Path, args: argparse.Namespace, device: torch.device, dtype: str, n_params: int
) -> Row:
    from lightning_core.algo.config import TrainerConfig
    from lightning_core.algo.trainer import LoRATrainer
    from lightning_core.types import Transition

    trainer = LoRATrainer(
        TrainerConfig(
            model=str(folder),
            device=str(device),
            dtype=dtype,
            micro_batch_tokens=args.micro_batch_tokens,
        )
    )
    vocab = trainer.model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(1)
    half = args.train_tokens // 2
    batch = [
        Transition(
            rollout_id=f"ro-{i}",
            step=0,
            prompt_token_ids=torch.randint(2, vocab, (half,), generator=g).tolist(),
            response_token_ids=torch.randint(2, vocab, (half,), generator=g).tolist(),
            response_logprobs=[-5.0] * half,
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(args.train_rows)
    ]
    trainer.step(batch)  # warm-up: kernels, optimizer state
    sync(device)
    t0 = time.perf_counter()
    trainer.step(batch)
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = args.train_rows * 2 * half
    print(f"train step: {tokens} tokens in {seconds:.2f} s", flush=True)
    return Row("train", f"{args.train_rows} x {2 * half} tokens", tokens, seconds, 4 * n_params)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU in float32 (for CI)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 128 (dry: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (dry: 8)")
    parser.add_argument("--train-rows", type=int, default=None, help="default 64 (dry: 4)")
    parser.add_argument(
        "--train-tokens", type=int, default=None, help="per row, default 512 (dry: 32)"
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="default 16384")
    args = parser.parse_args(argv)
    gpu = {"prompt_tokens": 128, "new_tokens": 128, "train_rows": 64, "train_tokens": 512}
    dry = {"prompt_tokens": 16, "new_tokens": 8, "train_rows": 4, "train_tokens": 32}
    for name, value in (dry if args.dry_run else gpu).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.micro_batch_tokens is None:
        args.micro_batch_tokens = 16384
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    if args.dry_run:
        device, dtype, dtype_name = torch.device("cpu"), torch.float32, "float32"
        matmul_n, repeats = 1024, 5
    elif not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; run with --dry-run for the CPU check", file=sys.stderr
        )
        return 2
    else:
        device, dtype, dtype_name = torch.device("cuda"), torch.bfloat16, "bfloat16"
        matmul_n, repeats = 8192, 50
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"

    peak = matmul_flops(dtype, device, matmul_n, repeats)
    print(
        f"device: {where}; {dtype_name} matmul {matmul_n}^2: {peak / 1e12:.2f} TFLOP/s", flush=True
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        folder = Path(tmp) / ("tiny-qwen2" if args.dry_run else "random-qwen2.5-1.5b")
        n_params, vocab = build_model(folder, args.dry_run, dtype, device)
        print(
            f"model: random Qwen2 {n_params / 1e6:.1f}M params, vocab {vocab} "
            f"({'tiny dry-run shape' if args.dry_run else CONFIG.name}); token ids are "
            "random-model tokens",
            flush=True,
        )
        rows = asyncio.run(decode(folder, args, device, dtype_name, n_params))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(train_step(folder, args, device, dtype_name, n_params))

    print()
    print("| phase | shape | tokens | seconds | tokens/s | model TFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        mfu = row.tflops() * 1e12 / peak
        print(
            # Enough decimals that the dry run's toy model (a train step of ~5 ms, 0.0005
            # TFLOP/s at one request) never prints 0: a fresh-clone CI run read "0.00" s.
            f"| {row.phase} | {row.shape} | {row.tokens} | {row.seconds:.4f} | "
            f"{row.tokens_per_s:.1f} | {row.tflops():.6f} | {100 * mfu:.2f} % |"
        )
    print(
        f"MFU against the measured {dtype_name} matmul rate {peak / 1e12:.2f} TFLOP/s; "
        f"decode 2*N, train 4*N FLOPs per token (LoRA, frozen base), N = {n_params}"
    )
    print()
    save = not args.dry_run  # the dry run's figures measure nothing
    record("gpu_check_matmul_tflops", f"{peak / 1e12:.3f}", save=save)
    for row in rows:
        key = row.shape.split()[0] if row.phase == "decode" else ""
        name = f"gpu_check_{row.phase}" + (f"_{{}}_{key}" if key else "_{}")
        record(name.format("tokens_per_s"), f"{row.tokens_per_s:.1f}", save=save)
        record(name.format("mfu"), f"{row.tflops() * 1e12 / peak:.4f}", save=save)
    record("gpu_check_seconds", f"{time.perf_counter() - started:.1f}", save=save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
