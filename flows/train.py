"""The training flow: iterations of rollouts, credit assignment, analytics, a LoRA update and
evaluation, then MLflow registration with a gated promotion. One call per stage, each in the
module named beside it:

    start      data plan, run folder, new or resumed checkpoint        flows/run_start.py
    serve      store + OpenAI-compatible gateway + backend (a child process), MLflow run
    calibrate  a judge (if any) against gold, refused below its bar    flows/judging.py
    evaluate   the base model on the held-out split (iteration 0)      flows/held_out.py
    each iteration k = 1..N, a subflow run `iteration-<k>`             flows/iteration.py
      rollouts   tasks drawn by the curriculum's tiers, G rollouts each on the current policy,
                 fanned out over workers (threads, Ray or Dask), collected into transitions
                 with LightningRL credit; more rounds while too few groups carry a signal
      analyze    Parquet export + DuckDB metrics (MLflow, Prefect table)
      train      LoRA policy-gradient update (global concurrency limit "gpu")
      publish    adapter k registered as policy version <run>-v<k>; the next rollouts use it
      evaluate   every E iterations and at the end
      checkpoint the run folder's checkpoint.json: where a resumed run continues
    finish     compare base and final, register the MLflow model version (champion only if it
               beats the champion), report                            flows/run_end.py

With staleness > 0 the rollouts leave the iteration subflows: a producer thread runs them as
subflow runs `rollouts-<k>` on the newest published policy, up to `staleness` versions ahead of
training, and each iteration trains on its batch (flows/pipeline.py).

A run started again with the name of a run folder that has a checkpoint (`lightning-rl train
--resume <run>`, or a deployment run with the same run_name) continues after the last finished
iteration, in the same folder and the same MLflow run (flows/run_state.py).

With `policy_per_agent`, each trained agent has its own adapter and trainer: train splits the
iteration's transitions by agent, publish registers <run>-v<k>-<agent> per agent and <run>-v<k>,
which serves each agent's calls with its own, and that one version is evaluated, registered
(the agents' adapters in one model version) and promoted or refused as a whole.
"""

from __future__ import annotations

from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from lightning_rl.flows import judging, run_end, run_start
from lightning_rl.flows.batch_source import rollouts_ahead
from lightning_rl.flows.config import TrainConfig, train_config_parameters
from lightning_rl.flows.iteration import train_iteration
from lightning_rl.redacted import flow

# The subflows, importable from here as before the flow was split into its stages' modules.
__all__ = ["run_training", "train", "train_iteration"]


def run_training(config: TrainConfig) -> dict[str, Any]:
    """The flow's body, for a validated config: one call per stage."""
    start = run_start.start_run(config)
    if not isinstance(start, run_start.Start):
        return start  # a recurring run that found nothing new
    config = start.config
    with run_start.serve(start) as (run, server, mlflow_run_id):
        checkpoint = run_start.begin(start, run, mlflow_run_id)
        judging.calibrate(config, start.agent, run, checkpoint)
        checkpoint = run_start.evaluate_start(start, run, checkpoint)
        view = run_end.IterationsView(start, checkpoint)
        with rollouts_ahead(config, run, checkpoint):
            for it in range(checkpoint.iteration + 1, config.iterations + 1):
                checkpoint = train_iteration.with_options(flow_run_name=f"iteration-{it}")(
                    config=config, run=run, checkpoint=checkpoint, iteration=it
                )
                view.finished(checkpoint, server.restarts)
        summary = run_end.finish(start, run, checkpoint)
    return run_end.done(start, summary)


def _flow_run_name() -> str:
    # The flow run is named after the run (a resumed run's flow runs share its name); without
    # a run_name yet, after the agent.
    from prefect.runtime import flow_run

    params = flow_run.parameters
    return str(params.get("run_name") or f"train-{params.get('agent') or 'calc'}")


@flow(
    name="train",
    flow_run_name=_flow_run_name,
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=16),
)
@train_config_parameters
def train(**params: Any) -> dict[str, Any]:
    """Train an agent's policy with LightningRL; every parameter is a field of TrainConfig
    (flows/config.py), where each is described."""
    return run_training(TrainConfig.model_validate(params))
