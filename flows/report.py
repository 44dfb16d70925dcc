"""The run report users read: a reward curve (PNG) and markdown with the numbers that matter."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pandas as pd

from lightning_core.stats.evaluation import EvalResult


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) from free-form names."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


def reward_curve(
    history: pd.DataFrame, evals: list[tuple[int, EvalResult]], path: Path, title: str
) -> Path:
    """Training reward and success per iteration, held-out score (with its 95 % CI) at
    each evaluation, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and workers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if not history.empty:
        reward, success = history["rollout/reward_mean"], history["rollout/success_rate"]
        if (reward - success).abs().max() < 1e-9:  # 0/1 rewards: one line says both
            ax.plot(history["iteration"], reward, "o-", label="train reward (= success rate)")
        else:
            ax.plot(history["iteration"], reward, "o-", label="train reward")
            ax.plot(history["iteration"], success, "s--", label="train success")
    if evals:
        xs = [i for i, _ in evals]
        ys = [e.score for _, e in evals]
        # max(0, ...): the interval's ends carry float error around accuracies of 0 and 1.
        low = [max(0.0, e.score - e.ci_low) for _, e in evals]
        high = [max(0.0, e.ci_high - e.score) for _, e in evals]
        ax.errorbar(xs, ys, yerr=[low, high], fmt="D-", capsize=4, label="held-out score")
    ax.set_xlabel("iteration")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """A matplotlib figure laid out, written to `path` (its folder made) and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


SIGNAL_SHARE = "rollout/signal_share"


def with_signal_share(history: pd.DataFrame) -> pd.DataFrame:
    """The history with the share of each iteration's groups that had a learning signal, where
    it logged the groups drawn and those with a signal (dynamic sampling's metrics)."""
    drawn, signal = "rollout/tasks_drawn", "rollout/groups_with_signal"
    if drawn not in history.columns or signal not in history.columns:
        return history
    share = history[signal] / history[drawn].where(history[drawn] > 0)
    return history.assign(**{SIGNAL_SHARE: share})


def _table(frame: pd.DataFrame, columns: list[str]) -> str:
    shown = [c for c in columns if c in frame.columns]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    # Row by row as records, not iterrows: iterrows makes each row one dtype, and the integer
    # iteration column came out as `1.000`.
    for row in frame[shown].to_dict("records"):
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(
    title: str,
    history: pd.DataFrame,
    evals: list[tuple[int, EvalResult]],
    curve: Path,
    decision: Any = None,
    extra: dict[str, Any] | None = None,
    live: pd.DataFrame | None = None,
    sections: list[str] | None = None,
) -> str:
    """The report: held-out scores, the curve (inline PNG), per-iteration metrics, the live
    reward per policy version (a run on production episodes), `sections` (markdown lines, such
    as flows/learning.py's per-tier tables), promotion."""
    parts = [f"# {title}", ""]
    if evals:
        base, final = evals[0][1], evals[-1][1]
        gain = (final.score - base.score) * 100
        parts += [
            "## Held-out score (greedy)",
            "",
            "| iteration | policy | score | 95 % CI | tasks |",
            "|---|---|---|---|---|",
            *(
                f"| {i} | {e.policy_version} | {e.score:.1%} | "
                f"{e.ci_low:.1%} - {e.ci_high:.1%} | {e.tasks} |"
                for i, e in evals
            ),
            "",
            f"Gain over the base model: **{gain:+.1f} points**.",
            "",
        ]
    history = with_signal_share(history)
    encoded = base64.b64encode(curve.read_bytes()).decode()
    parts += [
        "## Reward curve",
        "",
        f"![reward curve](data:image/png;base64,{encoded})",
        "",
        f"(PNG: `{curve}`)",
        "",
        "## Iterations",
        "",
        _table(
            history,
            [
                "iteration",
                "rollout/reward_mean",
                "rollout/success_rate",
                "rollout/actions_per_episode",
                "rollout/tokens_per_action",
                "rollout/tool_error_rate",
                "credit/zero_advantage_fraction",
                "rollout/tasks_drawn",
                SIGNAL_SHARE,
                "rollout/groups_mixed_success",
            ],
        ),
        "",
    ]
    if SIGNAL_SHARE in history.columns:
        parts += [
            f"`{SIGNAL_SHARE}`: the share of the iteration's groups (tasks drawn) whose "
            "rollouts did not all earn the same reward; a group without one teaches nothing.",
            "",
        ]
    if live is not None and not live.empty:
        parts += [
            "## Live reward per policy version",
            "",
            "The feedback of the production episodes this run trained on (and of the archive, "
            "with `data.episodes_archive`): per episode the mean of its sources, then the mean "
            "over the version's episodes, +- a 95 % interval.",
            "",
            _table(live, ["policy_version", "episodes", "feedback", "reward_mean", "reward_ci95"]),
            "",
        ]
    parts += sections or []
    if decision is not None:
        parts += ["## Registry", "", f"{decision}", ""]
    for key, value in (extra or {}).items():
        parts.append(f"- {key}: {value}")
    return "\n".join(parts)
