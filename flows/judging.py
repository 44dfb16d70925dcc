"""The run's judge (docs/judge.md): its setup from the config and the agent's brief, and its
calibration against gold before the first iteration, logged to MLflow and enforced.

The calibration's verdict is saved in the run's folder, so a resumed run neither pays for it
again nor changes its mind.
"""

from __future__ import annotations

import random
from pathlib import Path

from prefect import get_run_logger

from lightning_core.errors import InvalidInput
from lightning_core.judge.calibration import Calibration, enforce
from lightning_core.judge.config import SERVER
from lightning_rl.flows.config import TrainConfig
from lightning_rl.flows.profiles import AgentProfile
from lightning_rl.flows.run_context import RunContext, credit, train_tasks
from lightning_rl.flows.run_state import Checkpoint
from lightning_rl.judge_setup import CACHE_FILE, JudgeSetup, spend
from lightning_rl.registry.runs import log_metrics_once, set_run_tags
from lightning_rl.tasks.judging import calibrate_judge

CALIBRATION_FILE = "judge_calibration.json"


def check_judge(config: TrainConfig, agent: AgentProfile) -> None:
    """Refuse a judge the run could not use, before any folder or server exists."""
    if config.judge.enabled and config.judge.rubric is None and agent.judge is None:
        raise InvalidInput(
            f"judge.endpoint is set but agent {agent.name!r} has no rubric; set judge.rubric"
        )


def judge_setup(config: TrainConfig, agent: AgentProfile, run: RunContext) -> JudgeSetup | None:
    """What tasks need to open the run's judge; None when the run has none."""
    judge = config.judge
    if not judge.enabled:
        return None
    check_judge(config, agent)
    server = judge.endpoint == SERVER
    return JudgeSetup(
        config=judge,
        rubric=judge.rubric or agent.judge.rubric,  # type: ignore[union-attr]
        task_fields=agent.judge.task_fields if agent.judge else ["question"],
        model=judge.model or run.base_model if server else judge.model,  # type: ignore[arg-type]
        base_url=f"{run.server_url}/v1" if server else judge.endpoint,  # type: ignore[arg-type]
        key_file=run.key_file if server else None,
        cache_path=str(Path(run.root) / CACHE_FILE),
    )


def spend_metrics(setup: JudgeSetup | None) -> dict[str, float]:
    """The judge's spend so far (calls, tokens, cache hits, failures), for an iteration's
    metrics."""
    return spend(setup).metrics() if setup is not None else {}


def calibrate(
    config: TrainConfig, agent: AgentProfile, run: RunContext, checkpoint: Checkpoint
) -> Calibration | None:
    """The judge against gold before the run trusts it: a new calibration, or the one the
    run saved; refused (InvalidInput) below judge.calibration.min_agreement_pct unless
    allow_below."""
    setup = judge_setup(config, agent, run)
    if setup is None or not config.judge.calibration.enabled:
        return None
    log, wanted = get_run_logger(), config.judge.calibration
    saved = Path(run.root) / CALIBRATION_FILE
    if saved.exists():
        result = Calibration.model_validate_json(saved.read_text())
    else:
        tasks = train_tasks(config, run.root)
        sample = random.Random(config.seed).sample(tasks, min(wanted.tasks, len(tasks)))
        gold = agent.judge.gold_threshold if agent.judge else None
        threshold = gold if gold is not None else credit(config, agent).success_threshold
        log.info(
            "calibrating the judge %s on %d trajectories",
            setup.model,
            len(sample) * wanted.group_size,
        )
        # An async task, submitted: the flow is sync (its result waits on the task's thread).
        result = calibrate_judge.submit(
            run.server_url,
            agent.agent,
            sample,
            setup,
            checkpoint.policy or run.base_model,
            f"{run.run_name}-calibration",
            config.rollouts.sampling,
            float(threshold if threshold is not None else 1.0),
            config.rollouts.rollout_concurrency,
            float(config.rollouts.rollout_timeout_s or agent.rollout_timeout_s),
            seed=config.seed,
            key_file=run.key_file,
            run_dir=run.root,
        ).result()
        saved.write_text(result.model_dump_json(indent=2))
        log_metrics_once(
            result.metrics() | spend_metrics(setup), step=0, run_id=checkpoint.mlflow_run_id
        )
    set_run_tags(
        {"judge": setup.model, "judge_agreement_pct": f"{result.agreement_pct:.1f}"},
        run_id=checkpoint.mlflow_run_id,
    )
    log.info(
        "judge %s against gold on %d trajectories: %.1f %% agreement, Spearman %s",
        setup.model,
        result.n,
        result.agreement_pct,
        "n/a" if result.spearman is None else f"{result.spearman:.2f}",
    )
    warning = enforce(result, wanted, setup.model)
    if warning is not None:
        log.warning(warning)
    return result
