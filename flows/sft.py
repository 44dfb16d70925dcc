"""warm_start=sft, the supervised warm start before RL: the base policy sampled on train tasks,
its successful episodes kept (rejection sampling), and an adapter fine-tuned on their calls
(tasks/warm_start.py), published as the run's policy v0. RL then starts from it.

Episodes from production with good feedback are the other source of such a start: a run with
`data=episodes` and `data.offline.method=filtered` fine-tunes on them the same way.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from prefect import get_run_logger

from lightning_core.data.adapter import AdapterConfig
from lightning_core.errors import InvalidInput
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.pipeline import PolicyRef
from lightning_rl.flows.profiles import AgentProfile
from lightning_rl.flows.run_context import RunContext, air, credit, train_tasks
from lightning_rl.flows.run_state import Checkpoint
from lightning_rl.registry.runs import log_metrics_once, set_run_tags
from lightning_rl.tasks.training import publish_policy
from lightning_rl.tasks.warm_start import sample_successes, sft_policy

SFT_ADAPTER = "sft"


def check_sft(config: TrainConfig) -> None:
    """Refuse what the supervised warm start cannot do, before any folder or server."""
    if config.warm_start == "sft" and config.policy_per_agent:
        raise InvalidInput(
            "warm_start=sft fine-tunes one adapter; it cannot start a policy_per_agent run"
        )


def sft_warm_start(
    config: TrainConfig, agent: AgentProfile, run: RunContext, checkpoint: Checkpoint
) -> Checkpoint:
    """The checkpoint with the fine-tuned adapter as policy v0; unchanged (the base model)
    when no sampled episode succeeded, which the log and the run's tags say."""
    log, wanted, started = get_run_logger(), config.sft, time.perf_counter()
    tasks = train_tasks(config, run.root)
    sample = random.Random(config.seed).sample(tasks, min(wanted.tasks, len(tasks)))
    threshold = wanted.min_reward
    if threshold is None:
        threshold = credit(config, agent).success_threshold
    adapter = AdapterConfig(
        agents=config.train_agents or agent.train_agents, air=air(agent, config)
    )
    log.info(
        "warm start (sft): sampling %d episodes of the base policy",
        len(sample) * wanted.samples_per_task,
    )
    kept, sampled = sample_successes.submit(
        run.server_url,
        agent.agent,
        sample,
        wanted.samples_per_task,
        run.base_model,
        f"{run.run_name}-sft",
        config.rollouts.sampling,
        config.rollouts.rollout_concurrency,
        float(config.rollouts.rollout_timeout_s or agent.rollout_timeout_s),
        adapter,
        float(threshold if threshold is not None else 1.0),
        seed=config.seed,
        key_file=run.key_file,
        run_dir=run.root,
    ).result()
    if not kept:
        log.warning("warm start (sft): no sampled episode succeeded; starting from the base model")
        set_run_tags({"warm_start": "base (sft found no success)"}, run_id=checkpoint.mlflow_run_id)
        log_metrics_once(sampled, step=0, run_id=checkpoint.mlflow_run_id)
        return checkpoint
    trainer = config.trainer.model_copy(update={"model": config.server.model, "seed": config.seed})
    if wanted.learning_rate is not None:
        trainer = trainer.model_copy(update={"learning_rate": wanted.learning_rate})
    adapter_dir = str(Path(run.root) / "adapters" / SFT_ADAPTER)
    trained = sft_policy(
        trainer, kept, adapter_dir, wanted.epochs, wanted.updates_per_epoch, config.seed
    )
    policy = publish_policy(
        run.server_url,
        PolicyRef(run=run.run_name, index=0).name(),
        run.base_model,
        adapter_dir,
        0,
        key_file=run.key_file,
    )
    minutes = (time.perf_counter() - started) / 60
    log_metrics_once(
        sampled | trained | {"sft/minutes": minutes}, step=0, run_id=checkpoint.mlflow_run_id
    )
    set_run_tags(
        {"warm_start": f"sft ({int(sampled['sft/successes'])} episodes)"},
        run_id=checkpoint.mlflow_run_id,
    )
    log.info(
        "warm start (sft): %d of %d episodes succeeded; %d calls, %d steps, loss %.3f -> %.3f, "
        "%.1f min",
        sampled["sft/successes"],
        sampled["sft/episodes"],
        sampled["sft/transitions"],
        trained["sft/steps"],
        trained["sft/first_loss"],
        trained["sft/last_loss"],
        minutes,
    )
    return checkpoint.model_copy(update={"policy": policy, "adapter_dir": adapter_dir})
