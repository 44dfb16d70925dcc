"""Prefect tasks of the supervised warm start (warm_start=sft): the base policy's successful
episodes, found by sampling (rejection sampling), and a LoRA adapter fine-tuned on their calls.

The fine-tuning maximises the likelihood of the kept calls' response tokens given their exact
prompts, as the gateway recorded them: the same tokens, templates and agent filter as RL
trains on, so the adapter it leaves is the RL run's policy v0 without any conversion.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.data.adapter import AdapterConfig
from lightning_core.data.collect import collect
from lightning_core.types import Sampling, Transition
from lightning_rl.gpu_slot import gpu_slot
from lightning_rl.policy_server import store_client
from lightning_rl.tasks.rollouts import sample_episodes
from lightning_rl.tasks.training import mean_metrics, save_adapter, split_updates


@task(
    name="sample-successes",
    retries=1,
    retry_delay_seconds=5,
    timeout_seconds=6 * 3600,
    cache_policy=NO_CACHE,
)
async def sample_successes(
    server_url: str,
    agent: str,
    tasks: list[dict[str, Any]],
    samples_per_task: int,
    policy_version: str,
    group_prefix: str,
    sampling: Sampling,
    concurrency: int,
    rollout_timeout_s: float,
    adapter: AdapterConfig,
    min_reward: float,
    seed: int | None = None,
    key_file: str | None = None,
    run_dir: str | None = None,
) -> tuple[list[Transition], dict[str, float]]:
    """The calls of the episodes of `policy_version` on `tasks` whose reward reached
    `min_reward`, each distinct (prompt, response) once; and what was sampled."""
    ids = await sample_episodes(
        server_url,
        agent,
        tasks,
        samples_per_task,
        policy_version,
        group_prefix,
        sampling,
        concurrency,
        rollout_timeout_s,
        seed,
        key_file,
        run_dir,
        "sft",
    )
    async with store_client(server_url, key_file) as store:
        rollouts = await store.query_rollouts(rollout_ids=ids)
        spans = await store.query_spans(ids, "latest")
    collected = collect(rollouts, spans, adapter)
    winners = {r for r, facts in collected.facts.items() if facts.episode_return >= min_reward}
    kept: dict[tuple[tuple[int, ...], tuple[int, ...]], Transition] = {}
    for t in collected.transitions:
        if t.rollout_id in winners:
            kept.setdefault((tuple(t.prompt_token_ids), tuple(t.response_token_ids)), t)
    return list(kept.values()), {
        "sft/episodes": float(len(collected.facts)),
        "sft/successes": float(len(winners)),
        "sft/success_rate": len(winners) / max(len(collected.facts), 1),
        "sft/transitions": float(len(kept)),
    }


# No retries, as train-policy: a retried update would be applied twice.
@task(name="sft-policy", timeout_seconds=6 * 3600, tags=["gpu"], cache_policy=NO_CACHE)
def sft_policy(
    trainer_config: TrainerConfig,
    transitions: list[Transition],
    adapter_dir: str,
    epochs: int,
    updates_per_epoch: int,
    seed: int = 0,
) -> dict[str, float]:
    """A new adapter fine-tuned on `transitions` (likelihood of their responses), `epochs`
    passes of `updates_per_epoch` optimizer steps each, saved to `adapter_dir`."""
    with gpu_slot():
        trainer = LoRATrainer(trainer_config)
        trainer.frozen = None
        steps = [
            trainer.step(part, objective="likelihood")
            for epoch in range(epochs)
            for part in split_updates(transitions, updates_per_epoch, seed + epoch)
        ]
        save_adapter(trainer, adapter_dir)
    means = mean_metrics(steps) if steps else {}
    first = steps[0]["train/loss"] if steps else float("nan")
    return {f"sft/{k.removeprefix('train/')}": v for k, v in means.items()} | {
        "sft/first_loss": first,
        "sft/last_loss": steps[-1]["train/loss"] if steps else float("nan"),
        "sft/steps": float(len(steps)),
    }
