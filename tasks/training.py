"""Prefect tasks of the update stage: train the LoRA policy, publish it to the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from lightning_core.algo.trainer import LoRATrainer
from lightning_core.errors import Conflict
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import PolicyVersion, Transition

# The global concurrency limit that serialises accelerator work across flow runs.
GPU_LIMIT = "gpu"


def ensure_gpu_limit(slots: int = 1) -> None:
    """Create the `gpu` global concurrency limit (one slot) unless it exists already, so that
    training steps of concurrent flow runs take turns on the accelerator. A team sizes it
    with `prefect gcl update gpu --limit N` (or creates it first); this leaves theirs alone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another run was first
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=slots)
                )


def _mean(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = dicts[0].keys() if dicts else []
    return {k: sum(d[k] for d in dicts) / len(dicts) for k in keys}


# No retries: an update that failed after its optimizer step would be applied twice.
@task(name="train-policy", timeout_seconds=6 * 3600, tags=["gpu"], cache_policy=NO_CACHE)
def train_policy(
    trainer: LoRATrainer,
    transitions: list[Transition],
    adapter_dir: str,
    updates: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """`updates` policy-gradient steps on the transitions that carry a signal; save the adapter.

    Transitions whose advantage is 0 (every rollout of their group got the same reward) add
    nothing to the gradient but their compute, so they are left out.
    """
    batch = [t for t in transitions if t.advantage]
    metrics: dict[str, Any] = {
        "train/transitions": float(len(batch)),
        "train/skipped_transitions": float(len(transitions) - len(batch)),
    }
    with concurrency(GPU_LIMIT, occupy=1, strict=True):
        if batch:
            random.Random(seed).shuffle(batch)
            parts = max(1, min(updates, len(batch)))
            steps = [trainer.step(batch[i::parts]) for i in range(parts)]
            metrics |= _mean(steps)
        trainer.save(adapter_dir)
    return metrics


@task(
    name="publish-policy",
    retries=3,
    retry_delay_seconds=2,
    timeout_seconds=120,
    cache_policy=NO_CACHE,
)
def publish_policy(
    server_url: str, name: str, base_model: str, adapter_dir: str, iteration: int
) -> str:
    """Register the adapter as policy version `name`: the gateway serves it by that name from
    the next request on (it loads the adapter on first use)."""
    version = PolicyVersion(
        name=name,
        base_model=base_model,
        adapter_path=str(Path(adapter_dir).resolve()),
        metadata={"iteration": iteration},
    )

    async def add() -> str:
        async with HttpStoreClient(server_url) as store:
            try:
                await store.add_policy_version(version)
            except Conflict:
                # A retry after a lost response: the version is there, with this adapter.
                existing = await store.get_policy_version(name)
                if existing.adapter_path != version.adapter_path:
                    raise
            return name

    return asyncio.run(add())
