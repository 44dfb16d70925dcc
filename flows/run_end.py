"""How a training run ends: base and final compared on the same held-out tasks, the final
adapter registered in MLflow (promoted only through the gate), and the report: reward curve,
Prefect artifacts and the summary the CLI prints."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from lightning_core.data import analytics
from lightning_core.stats.comparison import Comparison, compare
from lightning_core.stats.evaluation import EvalResult
from lightning_rl import progress
from lightning_rl.flows import data_plan, learning, report
from lightning_rl.flows.run_context import (
    RunContext,
    credit,
    heldout_tasks,
    policy_agents,
    train_tasks,
)
from lightning_rl.flows.run_start import Start
from lightning_rl.flows.run_state import Checkpoint
from lightning_rl.registry.promotion import PromotionDecision
from lightning_rl.registry.runs import log_artifact, log_metrics_once, set_run_tags
from lightning_rl.tasks.registry import register_policy


class IterationsView:
    """The Prefect UI's view of a run's iterations: a progress bar and the table of their
    metrics, updated after each; and the policy server's restarts as an MLflow metric."""

    def __init__(self, start: Start, checkpoint: Checkpoint) -> None:
        self._start = start
        self._bar = create_progress_artifact(
            progress=100.0 * checkpoint.iteration / start.config.iterations,
            key=report.artifact_key(start.agent.name, "training-progress"),
            description=f"Iterations of {start.config.run_name} finished, in percent of "
            f"{start.config.iterations}",
        )

    def finished(self, checkpoint: Checkpoint, server_restarts: int) -> None:
        it, start = checkpoint.iteration, self._start
        # Restarts of the policy server so far (it is brought back when it dies).
        log_metrics_once(
            {"server/restarts": server_restarts}, step=it, run_id=checkpoint.mlflow_run_id
        )
        update_progress_artifact(self._bar, progress=100.0 * it / start.config.iterations)
        create_table_artifact(
            checkpoint.history,
            key=report.artifact_key(start.agent.name, "iterations"),
            description=f"Per-iteration metrics of {start.config.run_name} (as logged to MLflow)",
        )


def _compare(start: Start, evals: list[tuple[int, EvalResult]]) -> Comparison:
    """Base and final on the same tasks: per-tier rows and the paired interval of the gain."""
    config = start.config
    comparison = compare(
        evals[0][1],
        evals[-1][1],
        start.test_tasks,
        config.curriculum.tier_key,
        credit(config, start.agent).success_threshold,
        config.seed,
    )
    (start.root / "heldout_comparison.json").write_text(comparison.model_dump_json(indent=2))
    get_run_logger().info("held-out, base vs final:\n%s", comparison.markdown())
    return comparison


def _compare_splits(start: Start, checkpoint: Checkpoint) -> dict[str, dict[str, Any]]:
    """Each extra held-out split, base vs final: written beside the test split's comparison
    (heldout_<split>_comparison.json) and logged; the summary's `splits`."""
    config, found = start.config, {}
    for split, evals in checkpoint.split_evaluations.items():
        if len(evals) < 2:
            continue  # a run stopped before its end: no final to compare
        base, final = evals[0].restored(), evals[-1].restored()
        tasks = heldout_tasks(config, split)
        threshold = credit(config, start.agent).success_threshold
        comparison = compare(base, final, tasks, config.curriculum.tier_key, threshold, config.seed)
        path = start.root / f"heldout_{split}_comparison.json"
        path.write_text(comparison.model_dump_json(indent=2))
        get_run_logger().info("held-out split %r, base vs final:\n%s", split, comparison.markdown())
        shown = comparison.markdown()
        if any("kind" in t for t in tasks):
            by_kind = learning.heldout_by_group([(0, base), (1, final)], tasks, "kind", threshold)
            shown += "\n\nPer question kind (0: base, 1: final):\n\n"
            shown += "\n".join(learning.heldout_table(by_kind))
        found[split] = {
            "base": base.model_dump(),
            "final": final.model_dump(),
            "gain_points": comparison.gain_points,
            "gain_ci_points": list(comparison.gain_ci_points),
            "per_tier": [r.model_dump() for r in comparison.rows],
            "markdown": shown,
        }
    return found


def _register(start: Start, checkpoint: Checkpoint, final: EvalResult) -> PromotionDecision:
    """The final adapter as a model version; champion only if it passes the gate."""
    decision = register_policy(
        start.registry,
        checkpoint.adapter_dir,
        start.config.server.model or "smollm2",
        checkpoint.policy,
        start.config.iterations,
        final.score,
        # None only from a checkpoint written before scores had one: refused, with why.
        benchmark_id=final.benchmark_id or "",
        benchmark_size=final.tasks,
        run_id=checkpoint.mlflow_run_id,
    )
    get_run_logger().info("registry: %s", decision.reason)
    # The data is taken: the next recurring run reads on from this run's watermark.
    set_run_tags({data_plan.TAG_COMPLETE: "true"}, run_id=checkpoint.mlflow_run_id)
    return decision


def _summary(
    start: Start,
    checkpoint: Checkpoint,
    evals: list[tuple[int, EvalResult]],
    comparison: Comparison,
    decision: PromotionDecision,
    curve: str,
    splits: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    base, final = evals[0][1], evals[-1][1]
    config = start.config
    return {
        "run": config.run_name,
        "run_dir": str(start.root),
        "agent": start.agent.name,
        "iterations": config.iterations,
        "base": base.model_dump(),
        "final": final.model_dump(),
        "gain_points": round((final.score - base.score) * 100, 1),
        "gain_ci_points": list(comparison.gain_ci_points),
        "per_tier": [r.model_dump() for r in comparison.rows],
        "policy_version": checkpoint.policy,
        "adapter": checkpoint.adapter_dir,
        "policy_agents": policy_agents(config, start.agent),
        "promotion": decision.model_dump(),
        "reward_curve": curve,
        "minutes": round((time.time() - start.started) / 60, 1),
        "mlflow_run_id": checkpoint.mlflow_run_id,
        "data": start.plan.model_dump(),
        "benchmark_id": start.benchmark,
        "warm_start": config.warm_start,
        "splits": splits,
    }


def _report(
    start: Start,
    title: str,
    history: Any,
    evals: list[tuple[int, EvalResult]],
    comparison: Comparison,
    curve: Path,
    summary: dict[str, Any],
    live: Any = None,
    sections: list[str] | None = None,
) -> None:
    """The training report, the comparison and the held-out scores as Prefect artifacts."""
    agent = start.agent.name
    reason = summary["promotion"]["reason"]
    # The extra splits have their own artifacts (below): the summary's list shows the rest.
    listed = {k: v for k, v in summary.items() if k != "splits"}
    create_markdown_artifact(
        report.markdown(
            title, history, evals, curve, reason, extra=listed, live=live, sections=sections
        ),
        key=report.artifact_key(agent, "training-report"),
        description=f"Training report of {start.config.run_name}",
    )
    create_markdown_artifact(
        comparison.markdown(),
        key=report.artifact_key(agent, "heldout-comparison"),
        description="Base vs final on the held-out tasks, per tier, with the paired gain",
    )
    for split, found in summary["splits"].items():
        create_markdown_artifact(
            found["markdown"],
            key=report.artifact_key(agent, f"heldout-{split}-comparison"),
            description=f"Base vs final on the held-out split {split!r}, per tier",
        )
    create_table_artifact(
        [{"iteration": i, **e.model_dump()} for i, e in evals],
        key=report.artifact_key(agent, "heldout"),
        description="Held-out score per evaluation",
    )


def _history(start: Start) -> tuple[Any, Any, Any]:
    """The metrics per iteration, the live reward per policy version (empty unless the run
    trained on production episodes), and each training episode's task and success."""
    con = analytics.connect(start.root, ":memory:", start.config.data.episodes_archive)
    try:
        episodes = con.execute("SELECT iteration, task_id, success FROM episodes").df()
        return analytics.history(con), analytics.live_reward(con), episodes
    finally:
        con.close()


def _learning(
    start: Start, evals: list[tuple[int, EvalResult]], episodes: Any, title: str
) -> tuple[Path, list[str]]:
    """Training success and held-out score per tier (and per question kind, where tasks have
    one): CSV files and a PNG in the run folder, and the report's section."""
    config, root = start.config, start.root
    key, threshold = config.curriculum.tier_key, credit(config, start.agent).success_threshold
    train = learning.train_success_by_tier(episodes, train_tasks(config, str(root)), key)
    heldout = learning.heldout_by_group(evals, start.test_tasks, key, threshold)
    train.to_csv(root / "train_success_by_tier.csv", index=False)
    heldout.to_csv(root / "heldout_by_tier.csv", index=False)
    png = learning.tier_curves(train, heldout, root / "tier_curves.png", title)
    lines = [
        "## Where the learning is",
        "",
        f"![per tier](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})",
        "",
        "Held-out score per tier at each evaluation (95 % interval):",
        "",
        *learning.heldout_table(heldout),
        "",
    ]
    if any("kind" in t for t in start.test_tasks):
        kinds = learning.heldout_by_group(evals, start.test_tasks, "kind", threshold)
        kinds.to_csv(root / "heldout_by_kind.csv", index=False)
        lines += ["Per question kind:", "", *learning.heldout_table(kinds), ""]
    lines += [
        f"Training success per tier, rolling over {learning.WINDOW} iterations (episodes of "
        "the iteration):",
        "",
        *learning.train_table(train),
        "",
    ]
    return png, lines


def finish(start: Start, run: RunContext, checkpoint: Checkpoint) -> dict[str, Any]:
    """Compare, register, report; returns the run's summary."""
    evals = [(e.iteration, e.restored()) for e in checkpoint.evaluations]
    comparison = _compare(start, evals)
    decision = _register(start, checkpoint, evals[-1][1])
    title = f"{start.agent.name}: {run.run_name}"
    # Read once: the curve and the report show the same iterations.
    history, live, episodes = _history(start)
    curve = report.reward_curve(history, evals, start.root / "reward_curve.png", title)
    log_artifact(curve, run_id=checkpoint.mlflow_run_id)
    tiers_png, sections = _learning(start, evals, episodes, title)
    log_artifact(tiers_png, run_id=checkpoint.mlflow_run_id)
    splits = _compare_splits(start, checkpoint)
    summary = _summary(start, checkpoint, evals, comparison, decision, str(curve), splits)
    _report(start, title, history, evals, comparison, curve, summary, live, sections)
    return summary


def done(start: Start, summary: dict[str, Any]) -> dict[str, Any]:
    """The summary into the run folder and its progress file, once the policy server is down:
    `done` means nothing of the run is left running."""
    (start.root / "summary.json").write_text(json.dumps(summary, indent=2))
    progress.report(start.root, "done", **{k: v for k, v in summary.items() if k != "promotion"})
    return summary
