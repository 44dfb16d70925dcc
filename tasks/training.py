"""Prefect tasks of the update stage: train the LoRA policy, publish it to the gateway.

With one policy per agent (TrainConfig.policy_per_agent), each agent's trainer learns from its
agent's own transitions and saves into `<policy folder>/<agent>/`; the folder is then published
as one policy version whose calls are served per agent.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from lightning_core.algo import frozen
from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.distributed import train_data_parallel
from lightning_core.algo.prefix import call_key
from lightning_core.algo.trainer import LoRATrainer, agent_adapter_dirs
from lightning_core.data.offline import OfflineBatch, OfflineConfig, choose_method, filtered
from lightning_core.errors import Conflict, NotFound
from lightning_core.security.provenance import adapter_hash
from lightning_core.semconv import ADAPTER_HASH_METADATA
from lightning_core.types import PolicyVersion, Transition
from lightning_rl.gpu_slot import gpu_slot
from lightning_rl.policy_server import store_client


def mean_metrics(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = dicts[0].keys() if dicts else []
    return {k: sum(d[k] for d in dicts) / len(dicts) for k in keys}


# The trainer that saved the newest adapter, kept so the next iteration need not load the base
# model again. Keyed by that adapter folder and the trainer's config: a task given another
# folder (a resumed run, another run) loads that one from disk instead. Either way the trainer
# holds the saved weights, optimizer state and RNG state, so both give the same update.
_live: dict[tuple[str, str], tuple[LoRATrainer, torch.Tensor]] = {}
_live_lock = threading.Lock()


def _trainer(config: TrainerConfig, previous: str | None) -> LoRATrainer:
    """The trainer to continue from adapter folder `previous` (None: a new adapter)."""
    if previous is None:
        return LoRATrainer(config)
    key = (str(Path(previous).resolve()), config.model_dump_json())
    with _live_lock:
        live = _live.pop(key, None)
    if live is None:
        return LoRATrainer(config, adapter=previous)
    trainer, rng = live
    torch.set_rng_state(rng)  # as a trainer loaded from the folder would be
    return trainer


def save_adapter(trainer: LoRATrainer, adapter_dir: str) -> None:
    """Save into `adapter_dir` whole: written aside, then renamed over what a redone
    iteration left there."""
    final = Path(adapter_dir).resolve()
    staging = final.with_name(f".{final.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    trainer.save(staging)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    config = trainer.config.model_dump_json()
    with _live_lock:
        # One live trainer per config (per agent's adapter): the newest.
        for key in [k for k in _live if k[1] == config]:
            del _live[key]
        _live[(str(final), config)] = (trainer, torch.get_rng_state())


def split_updates(batch: Sequence[Transition], updates: int, seed: int) -> list[list[Transition]]:
    """The batch shuffled by `seed` and dealt into `updates` parts (fewer when the batch is
    smaller), one optimizer update each; none for an empty batch. The same calls make the
    same parts whatever order and rollout ids they come with (prefix.call_key)."""
    if not batch:
        return []
    shuffled = sorted(batch, key=call_key)
    random.Random(seed).shuffle(shuffled)
    parts = max(1, min(updates, len(shuffled)))
    return [shuffled[i::parts] for i in range(parts)]


# No retries: an update that failed after its optimizer step would be applied twice.
@task(name="train-policy", timeout_seconds=6 * 3600, tags=["gpu"], cache_policy=NO_CACHE)
def train_policy(
    trainer_config: TrainerConfig,
    transitions: list[Transition],
    previous_adapter: str | None,
    adapter_dir: str,
    updates: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Continue the adapter in `previous_adapter` (None: a new one) with `updates`
    policy-gradient steps on the transitions that carry a signal; save it to `adapter_dir`.

    Transitions whose advantage is 0 (every rollout of their group got the same reward) add
    nothing to the gradient but their compute, so they are left out.
    """
    batch = [t for t in transitions if t.advantage]
    metrics: dict[str, Any] = {
        "train/transitions": float(len(batch)),
        "train/skipped_transitions": float(len(transitions) - len(batch)),
    }
    if trainer_config.data_parallel > 1:
        return metrics | _train_data_parallel(
            trainer_config, batch, previous_adapter, adapter_dir, updates, seed
        )
    with gpu_slot():
        trainer = _trainer(trainer_config, previous_adapter)
        trainer.frozen = None  # fresh rollouts: no row comes back, nothing worth keeping
        steps = [trainer.step(part) for part in split_updates(batch, updates, seed)]
        if steps:
            metrics |= mean_metrics(steps)
        save_adapter(trainer, adapter_dir)
    return metrics


def _train_data_parallel(
    config: TrainerConfig,
    batch: list[Transition],
    previous_adapter: str | None,
    adapter_dir: str,
    updates: int,
    seed: int,
) -> dict[str, Any]:
    """train_policy's updates (the same shuffle and split) shared by `config.data_parallel`
    processes (lightning_core/algo/distributed.py), saved whole into `adapter_dir` as save_adapter
    does. No trainer stays live: the next iteration's processes load the saved folder."""
    final = Path(adapter_dir).resolve()
    with _live_lock:
        # Also a trainer kept for the folder about to be overwritten (a redone iteration).
        stale = [k for k in _live if k[1] == config.model_dump_json() or k[0] == str(final)]
        for key in stale:
            del _live[key]
    staging = final.with_name(f".{final.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    with gpu_slot():
        steps = train_data_parallel(
            config, split_updates(batch, updates, seed), previous_adapter, staging
        )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return mean_metrics(steps) if steps else {}


# No retries, as train-policy.
@task(name="train-offline", timeout_seconds=6 * 3600, tags=["gpu"], cache_policy=NO_CACHE)
def train_offline(
    trainer_config: TrainerConfig,
    batch: OfflineBatch,
    previous_adapter: str | None,
    adapter_dir: str,
    offline: OfflineConfig,
    updates: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Continue the adapter in `previous_adapter` on captured production episodes.

    The episodes were sampled by the policy that served them, not by this one. The gap
    between the two is measured on their tokens; while it is small the policy-gradient update
    corrects for it by the ratio to the recorded logprobs (importance weighting, clipped), and
    past `offline.max_behaviour_kl` (or when asked) the update is reward-filtered fine-tuning
    on the episodes that did well instead (offline.py). With method auto and one update, the
    gap comes from the update's own forward pass over the transitions it trains (those with an
    advantage); otherwise from a pass of its own over all of them, first.
    """
    with gpu_slot():
        trainer = _trainer(trainer_config, previous_adapter)
        # The run's iterations repeat these rows: their frozen activations are kept.
        mb = offline.frozen_cache_mb
        trainer.frozen = frozen.shared(mb) if mb else None
        learning = [t for t in batch.transitions if t.advantage]
        steps: list[dict[str, float]] = []
        if offline.method == "auto" and updates == 1 and learning:
            # One update on the whole batch: its own forward pass measures the gap (on the
            # transitions it trains, before it steps) and the update stands only if the gap
            # chooses importance weighting; a forward pass less than measuring first.
            gap, step = trainer.gated_step(
                learning, lambda found: choose_method(found, offline) == "importance"
            )
            method = "importance" if step is not None else "filtered"
            steps = [step] if step is not None else []
        else:
            gap = trainer.behaviour_gap(batch.transitions) if batch.transitions else {}
            method = offline.method if offline.method != "auto" else choose_method(gap, offline)
        if method == "filtered":
            chosen, objective = filtered(batch, offline), "likelihood"
        else:
            chosen, objective = learning, "policy_gradient"
        metrics: dict[str, Any] = {
            **gap,
            "offline/filtered": 1.0 if method == "filtered" else 0.0,
            "train/transitions": float(len(chosen)),
            "train/skipped_transitions": float(len(batch.transitions) - len(chosen)),
        }
        if not steps:
            parts = split_updates(chosen, updates, seed)
            steps = [trainer.step(part, objective=objective) for part in parts]
        if steps:
            metrics |= mean_metrics(steps)
        save_adapter(trainer, adapter_dir)
    return metrics


def agent_trainer_configs(config: TrainerConfig, agents: Sequence[str]) -> dict[str, TrainerConfig]:
    """One trainer config per agent; each adapter starts from its own seed, so they are
    independent from step 0."""
    return {
        name: config.model_copy(update={"seed": config.seed + i}) for i, name in enumerate(agents)
    }


def train_agent_policies(
    trainer_configs: Mapping[str, TrainerConfig],
    transitions: Sequence[Transition],
    previous_policy_dir: str | None,
    policy_dir: str,
    updates: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """One train-policy run per agent, on that agent's transitions only (so an agent's update
    leaves the others' adapters as they were), from `<previous_policy_dir>/<agent>/` to
    `<policy_dir>/<agent>/`.

    Metrics are per agent (`train/<agent>/loss`), plus `train/transitions` and
    `train/skipped_transitions` summed over the agents.
    """
    metrics: dict[str, Any] = {"train/transitions": 0.0, "train/skipped_transitions": 0.0}
    Path(policy_dir).mkdir(parents=True, exist_ok=True)
    for name, config in trainer_configs.items():
        own = [t for t in transitions if t.agent_name == name]
        previous = str(Path(previous_policy_dir) / name) if previous_policy_dir else None
        trained = train_policy.with_options(task_run_name=f"train-policy-{name}")(
            config, own, previous, str(Path(policy_dir) / name), updates, seed
        )
        for key in ("train/transitions", "train/skipped_transitions"):
            metrics[key] += trained[key]
        metrics |= {f"train/{name}/{k.removeprefix('train/')}": v for k, v in trained.items()}
    return metrics


class Update(BaseModel):
    """One iteration's LoRA update: from which adapter to which folder, and with which trainer."""

    trainer: TrainerConfig
    previous_adapter: str | None = Field(description="Adapter to continue (None: a new one).")
    adapter_dir: str = Field(description="Folder the updated adapter is saved into, whole.")
    updates: int = Field(1, description="Optimizer updates the batch is split into.")
    seed: int = Field(0, description="Seeds the batch's shuffle.")
    agents: list[str] | None = Field(
        None, description="One adapter per agent, each on its own calls (policy_per_agent)."
    )
    offline: OfflineConfig | None = Field(
        None, description="Set for captured production episodes (data=episodes)."
    )


def update_policy(
    update: Update, transitions: Sequence[Transition] = (), batch: OfflineBatch | None = None
) -> dict[str, Any]:
    """The iteration's update, whichever trainer it takes: the offline trainer on `batch`,
    one train-policy per agent, or train-policy on the transitions. Returns its metrics."""
    if update.offline is not None:
        if batch is None:
            raise ValueError("an offline update needs the episodes' batch")
        return train_offline(
            update.trainer,
            batch,
            update.previous_adapter,
            update.adapter_dir,
            update.offline,
            update.updates,
            update.seed,
        )
    if update.agents:
        return train_agent_policies(
            agent_trainer_configs(update.trainer, update.agents),
            transitions,
            update.previous_adapter,
            update.adapter_dir,
            update.updates,
            update.seed,
        )
    return train_policy(
        update.trainer,
        list(transitions),
        update.previous_adapter,
        update.adapter_dir,
        update.updates,
        update.seed,
    )


def _policy_versions(
    name: str, base_model: str, adapter_dir: str, iteration: int
) -> list[PolicyVersion]:
    """The versions that publish a policy folder: itself for one shared adapter; for one adapter
    per agent, a version per agent (`<name>-<agent>`), then `name` mapping each agent to its own.
    Each adapter's content hash is declared (docs/provenance.md): the gateway refuses to serve a
    folder rewritten since, and the run's record of what it served is these hashes."""
    folder = Path(adapter_dir).resolve()
    agents = agent_adapter_dirs(folder)
    if not agents:
        return [
            PolicyVersion(
                name=name,
                base_model=base_model,
                adapter_path=str(folder),
                metadata={"iteration": iteration, ADAPTER_HASH_METADATA: adapter_hash(folder)},
            )
        ]
    own = [
        PolicyVersion(
            name=f"{name}-{agent}",
            base_model=base_model,
            adapter_path=str(path),
            metadata={
                "iteration": iteration,
                "agent": agent,
                ADAPTER_HASH_METADATA: adapter_hash(path),
            },
        )
        for agent, path in agents.items()
    ]
    # No adapter of its own: calls of agents without one are served by the base model.
    together = PolicyVersion(
        name=name,
        base_model=base_model,
        agent_policies={v.metadata["agent"]: v.name for v in own},
        metadata={"iteration": iteration},
    )
    return [*own, together]


def published_version(
    server_url: str, name: str, key_file: str | None = None
) -> PolicyVersion | None:
    """Policy version `name` as the server's store holds it, or None: not published yet."""

    async def read() -> PolicyVersion | None:
        async with store_client(server_url, key_file) as store:
            try:
                return await store.get_policy_version(name)
            except NotFound:
                return None

    return asyncio.run(read())


@task(
    name="publish-policy",
    retries=3,
    retry_delay_seconds=2,
    timeout_seconds=120,
    cache_policy=NO_CACHE,
)
def publish_policy(
    server_url: str,
    name: str,
    base_model: str,
    adapter_dir: str,
    iteration: int,
    key_file: str | None = None,
) -> str:
    """Register the adapter as policy version `name`: the gateway serves it by that name from
    the next request on (it loads the adapter on first use). A folder of per-agent adapters
    (train_agent_policies) becomes one version per agent and `name`, which serves each agent's
    calls with its own; the agents' versions go first, so `name` never names a missing one."""
    versions = _policy_versions(name, base_model, adapter_dir, iteration)

    async def add() -> str:
        async with store_client(server_url, key_file) as store:
            for version in versions:
                try:
                    await store.add_policy_version(version)
                except Conflict:
                    # A retry after a lost response: the version is there, with this adapter.
                    existing = await store.get_policy_version(version.name)
                    if (existing.adapter_path, existing.agent_policies) != (
                        version.adapter_path,
                        version.agent_policies,
                    ):
                        raise
            return name

    return asyncio.run(add())
