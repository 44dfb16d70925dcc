"""Data-parallel LoRA updates: K processes share each update's batch (torch.distributed).

`train_data_parallel` launches `torchrun --standalone` (on loopback) with K copies of this
module. Each process builds the same trainer (the previous adapter folder, or a new adapter
from the same seed, then rank 0's weights broadcast so every copy starts alike), and for each
update backpropagates its share of the batch with every call weighted against the WHOLE batch
(trainer.loss_weights: by all its response tokens for token-mean), so that the gradients summed
over the processes (one all-reduce) are the single-process gradient. Every process then clips and
steps the same gradient, so the copies stay equal; rank 0 saves the adapter and optimizer state
with LoRATrainer.save, the same folder a single-process update saves.

Backend: NCCL when the processes train on CUDA (one GPU each), gloo on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.trainer import LoRATrainer, Objective
from lightning_core.errors import InvalidInput
from lightning_core.types import Transition

# The metrics' sums, all-reduced in this order.
_SUMS = (
    "loss",
    "kl",
    "clip_frac",
    "entropy",
    "tokens",
    "all_tokens",
    "is_ratio",
    "is_truncated",
    "ratio_masked",
    "forward_tokens",
)
# Lines of the processes' output a failure reports.
_TAIL_LINES = 40


def _device(config: TrainerConfig, world: int) -> str | None:
    """The device each process trains on (the rank's own GPU for CUDA), or None for the
    trainer's default; a clear error when there are fewer GPUs than processes."""
    wanted = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(wanted).type != "cuda":
        return config.device
    found = torch.cuda.device_count()
    if found < world:
        raise InvalidInput(
            f"data_parallel={world} on CUDA needs one GPU per process; {found} visible "
            "(lower data_parallel, or train on cpu)"
        )
    return "cuda"


def train_data_parallel(
    config: TrainerConfig,
    updates: Sequence[Sequence[Transition]],
    previous: str | Path | None,
    out: str | Path,
    objective: Objective = "policy_gradient",
) -> list[dict[str, float]]:
    """Continue the adapter in `previous` (None: a new one) with one update per batch in
    `updates`, each shared by `config.data_parallel` processes; save it to `out` as
    LoRATrainer.save does. Returns each update's `train/*` metrics, as LoRATrainer.step."""
    world = config.data_parallel
    device = _device(config, world)
    with tempfile.TemporaryDirectory(prefix="lightning-dp-") as scratch:
        job = Path(scratch)
        (job / "job.json").write_text(
            json.dumps(
                {
                    "config": config.model_copy(update={"device": device}).model_dump(),
                    "previous": str(previous) if previous is not None else None,
                    "out": str(Path(out).resolve()),
                    "objective": objective,
                    "updates": [[t.model_dump(mode="json") for t in u] for u in updates],
                }
            )
        )
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # a local rendezvous on a free port: nothing leaves the machine
            f"--nproc-per-node={world}",
            "-m",
            __name__,
            str(job),
        ]
        env = dict(os.environ)
        # gloo binds to the interface its host name resolves to; loopback is what it needs.
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        with open(job / "log.txt", "w") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        result_file = job / "result.json"
        result = json.loads(result_file.read_text()) if result_file.is_file() else {}
        if "error" in result:
            raise InvalidInput(result["error"])
        if code != 0 or "metrics" not in result:
            tail = "\n".join((job / "log.txt").read_text().splitlines()[-_TAIL_LINES:])
            raise RuntimeError(
                f"the data-parallel update ({world} processes) failed (exit {code}):\n{tail}"
            )
        return result["metrics"]


# ---------------------------------------------------------------------- one process (rank)


def _replicate(trainer: LoRATrainer) -> None:
    """Every rank's trainable weights set to rank 0's: a new adapter's initialisation could
    differ by device, a loaded one is the same file anyway."""
    for p in trainer.params:
        dist.broadcast(p.data, src=0)


def _all_reduce_gradients(trainer: LoRATrainer) -> None:
    """The gradients summed over the ranks, in one flat all-reduce. A rank whose share had no
    transition contributes zeros (a parameter with no gradient at all would be skipped by
    AdamW, unlike in the single-process step, where every LoRA weight gets one)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainer.params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p in trainer.params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def shares(trainer: LoRATrainer, transitions: Sequence[Transition], world: int) -> list[list]:
    """The batch dealt to `world` processes by whole rows (a merged chain stays on one): sorted
    by length, each gets a like share of short and long rows; with shared prefixes, runs of
    rows that share (a group's rows stay on one process, which computes their prompt once)."""
    rows = trainer._rows(transitions, trainer.config.prefix_merge)
    if trainer._sharing():
        # As many rows each as dealing gives, in contiguous runs.
        size, extra = divmod(len(rows), world)
        starts = [rank * size + min(rank, extra) for rank in range(world + 1)]
        dealt = [rows[starts[r] : starts[r + 1]] for r in range(world)]
    else:
        dealt = [rows[rank::world] for rank in range(world)]
    return [[t for row in share for t in row] for share in dealt]


def _update(
    trainer: LoRATrainer, batch: list[Transition], objective: Objective, rank: int, world: int
) -> dict[str, float]:
    """One data-parallel update: LoRATrainer.step with this rank's share of the batch and the
    gradients and metric sums all-reduced before the optimizer steps."""
    likelihood = objective == "likelihood"
    # Checked whole on every rank (each holds the batch): all ranks fail alike, none waits in
    # a collective for one that raised.
    trainer._check(batch, advantage=not likelihood, logprobs=not likelihood)
    trainer._rows(batch, merge=False)
    started = time.perf_counter()
    trainer.optimizer.zero_grad(set_to_none=True)
    share = shares(trainer, batch, world)[rank]
    sums = trainer.accumulate(share, objective, trainer.loss_weights(batch))
    _all_reduce_gradients(trainer)
    grad_norm = trainer.apply_gradients()
    totals = torch.tensor([sums[k] for k in _SUMS], dtype=torch.float64, device=trainer.device)
    dist.all_reduce(totals)
    seconds = torch.tensor([time.perf_counter() - started], device=trainer.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    summed = dict(zip(_SUMS, totals.tolist(), strict=True))
    largest = torch.tensor([sums["is_ratio_max"]], dtype=torch.float64, device=trainer.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    summed["is_ratio_max"] = float(largest)
    return trainer.step_metrics(summed, grad_norm, float(seconds)) | trainer.batch_metrics(batch)


def _rank_main(job: Path) -> int:
    spec: dict[str, Any] = json.loads((job / "job.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    config = TrainerConfig.model_validate(spec["config"])
    cuda = config.device is not None and torch.device(config.device).type == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        config = config.model_copy(update={"device": f"cuda:{local}"})
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        trainer = LoRATrainer(config, adapter=spec["previous"])
        _replicate(trainer)
        metrics = []
        try:
            for batch in spec["updates"]:
                transitions = [Transition.model_validate(t) for t in batch]
                metrics.append(_update(trainer, transitions, spec["objective"], rank, world))
        except InvalidInput as e:
            if rank == 0:
                (job / "result.json").write_text(json.dumps({"error": str(e)}))
            return 2
        if rank == 0:
            trainer.save(spec["out"])
            (job / "result.json").write_text(json.dumps({"metrics": metrics}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(Path(sys.argv[1])))
