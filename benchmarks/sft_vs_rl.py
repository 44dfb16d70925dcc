"""The supervised warm start against RL alone on the same held-out benchmark (issue 29, item 5).

    .venv/bin/python benchmarks/sft_vs_rl.py runs/<sft run> runs/<rl-alone run> [--split kinds]
    .venv/bin/python benchmarks/sft_vs_rl.py --quick   # two runs of a minute, then their table

The first run trained with warm_start=sft (make demo-sql-sft), the second from the base model
(make demo-sql). The warm-started run's first evaluation scores its policy v0 (the fine-tuned
adapter), not the base model, so the base model's per-task outcomes come from the RL-alone
run's first evaluation; both runs must have scored the same benchmark (same benchmark id).

Prints, per tier and for all tasks, the success rate of the base model, of the warm start alone
(v0), of the warm start then RL (final) and of RL alone (final), each with its Wilson 95 %
interval; then each gain over the base model and warm start + RL against RL alone, with paired
bootstrap 95 % intervals (tasks resampled with both outcomes, 10 000 draws, fixed seed), and
the minutes each run took from flow start to summary.

--quick (the tests run it) first trains the calc agent on the tiny random model twice into a
temporary folder (benchmarks/quick_train.py): once with a warm start that keeps every sampled
episode (`sft.min_reward` 0, since a random model succeeds at nothing) and once from the base
model, then reads the pair.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.quick_train import train_quick  # noqa: E402
from benchmarks.results import record  # noqa: E402
from lightning_core.rollouts.curriculum import tier_of  # noqa: E402
from lightning_core.stats.comparison import paired_bootstrap  # noqa: E402
from lightning_core.stats.evaluation import wilson_interval  # noqa: E402
from lightning_rl.flows.config import TrainConfig  # noqa: E402
from lightning_rl.flows.profiles import profile  # noqa: E402
from lightning_rl.flows.run_context import credit, heldout_tasks  # noqa: E402
from lightning_rl.flows.run_state import Checkpoint, Evaluation, load_checkpoint  # noqa: E402

COLUMNS = ("base", "sft", "sft+rl", "rl")
TIER_ORDER = ("easy", "medium", "hard")


def _run(parser: argparse.ArgumentParser, run: Path) -> tuple[TrainConfig, Checkpoint, dict]:
    summary, checkpoint = run / "summary.json", load_checkpoint(run)
    if checkpoint is None or not summary.is_file():
        parser.error(f"{run} is not a finished training run's folder (no checkpoint or summary)")
    config = TrainConfig.model_validate(json.loads((run / "config.json").read_text()))
    return config, checkpoint, json.loads(summary.read_text())


def _ends(
    parser: argparse.ArgumentParser, checkpoint: Checkpoint, split: str
) -> tuple[Evaluation, Evaluation]:
    evals = checkpoint.evaluations if split == "test" else checkpoint.split_evaluations.get(split)
    if not evals or len(evals) < 2:
        parser.error(f"a run holds fewer than two evaluations of split {split!r}")
    return evals[0], evals[-1]


def outcomes(
    parser: argparse.ArgumentParser, sft_run: Path, rl_run: Path, split: str
) -> tuple[list[dict], dict, dict, dict]:
    """Per held-out task: its tier and each column's success (0/1); and both summaries."""
    sft_config, sft_point, sft_summary = _run(parser, sft_run)
    _, rl_point, rl_summary = _run(parser, rl_run)
    if sft_config.warm_start != "sft":
        parser.error(f"{sft_run} did not start with warm_start=sft")
    v0, sft_final = _ends(parser, sft_point, split)
    base, rl_final = _ends(parser, rl_point, split)
    if v0.result.benchmark_id != base.result.benchmark_id:
        parser.error("the two runs scored different benchmarks (benchmark ids differ)")
    agent = profile(sft_config.agent, sft_config.tasks)
    threshold = credit(sft_config, agent).success_threshold or 1.0
    ends = dict(zip(COLUMNS, (base, v0, sft_final, rl_final), strict=True))
    rows = []
    for task in heldout_tasks(sft_config, split):
        tid = str(task["id"])
        # Tiered as the flow's own comparison tiers them (untiered tasks: "all" alone).
        row = {"tier": tier_of(task, sft_config.curriculum.tier_key)}
        for name, evaluation in ends.items():
            if tid not in evaluation.rewards:
                parser.error(f"task {tid} has no outcome in the {name} evaluation")
            row[name] = float(evaluation.rewards[tid] >= threshold)
        rows.append(row)
    names = {name: e.result.policy_version for name, e in ends.items()}
    return rows, sft_summary | {"agent": sft_config.agent}, rl_summary, names


def _rate(values: np.ndarray) -> str:
    k, n = int(values.sum()), len(values)
    low, high = wilson_interval(k, n)
    return f"{k / n:.1%} ({low:.1%}–{high:.1%})"


def _gain(diff: np.ndarray) -> tuple[float, float, float]:
    low, high = paired_bootstrap(diff)
    return 100 * float(diff.mean()), 100 * low, 100 * high


def table(rows: list[dict]) -> tuple[list[str], tuple[float, float, float], tuple]:
    """The markdown table, and the all-task gains of warm start + RL over the base and over
    RL alone."""
    lines = [
        "| tier | tasks | base | sft alone (v0) | sft + rl | rl alone | sft gain | sft + rl gain "
        "[paired 95 % CI] | rl alone gain | sft + rl vs rl alone |",
        "|---|---:|---|---|---|---|---:|---:|---:|---:|",
    ]
    tiers = sorted(
        {r["tier"] for r in rows} - {"all"},
        key=lambda t: (TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER), t),
    )
    for tier in [*tiers, "all"]:
        chosen = [r for r in rows if tier == "all" or r["tier"] == tier]
        col = {name: np.array([r[name] for r in chosen]) for name in COLUMNS}
        sft = _gain(col["sft"] - col["base"])
        both = _gain(col["sft+rl"] - col["base"])
        rl = _gain(col["rl"] - col["base"])
        versus = _gain(col["sft+rl"] - col["rl"])
        lines.append(
            f"| {tier} | {len(chosen)} | {_rate(col['base'])} | {_rate(col['sft'])} | "
            f"{_rate(col['sft+rl'])} | {_rate(col['rl'])} | {sft[0]:+.1f} | "
            f"{both[0]:+.1f} [{both[1]:+.1f}, {both[2]:+.1f}] | {rl[0]:+.1f} | "
            f"{versus[0]:+.1f} [{versus[1]:+.1f}, {versus[2]:+.1f}] |"
        )
    return lines, both, versus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sft_run", type=Path, nargs="?", help="the run with warm_start=sft")
    parser.add_argument("rl_run", type=Path, nargs="?", help="the run from the base model")
    parser.add_argument("--split", default="test", help="test, or an extra held-out split")
    parser.add_argument("--quick", action="store_true", help="train two tiny runs, read them")
    args = parser.parse_args(argv)
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="sft-vs-rl-quick-") as tmp:
            sft = '{"tasks": 2, "samples_per_task": 2, "min_reward": 0.0, "epochs": 1}'
            flags = ("--warm-start", "sft", "--sft", sft)
            sft_run = train_quick("calc", Path(tmp), "sft-quick", *flags)
            rl_run = train_quick("calc", Path(tmp), "rl-quick")
            report(parser, sft_run, rl_run, args.split, save=False)
        return
    if args.sft_run is None or args.rl_run is None:
        parser.error("name the warm-started run and the RL-alone run (or --quick)")
    report(parser, args.sft_run, args.rl_run, args.split)


def report(
    parser: argparse.ArgumentParser, sft_run: Path, rl_run: Path, split: str, save: bool = True
) -> None:
    rows, sft_summary, rl_summary, names = outcomes(parser, sft_run, rl_run, split)
    print(
        f"{len(rows)} held-out tasks of split {split}; "
        + ", ".join(f"{k} = {v}" for k, v in names.items())
    )
    print(
        f"minutes, flow start to summary: sft + rl {sft_summary['minutes']} "
        f"({sft_summary['iterations']} iterations), rl alone {rl_summary['minutes']} "
        f"({rl_summary['iterations']} iterations)\n"
    )
    lines, both, versus = table(rows)
    print("\n".join(lines))
    suffix = "" if split == "test" else f"_{split}"
    print()
    for name, (value, low, high) in (
        (f"{sft_summary['agent']}_sft_then_rl{suffix}_gain_points", both),
        (f"sft_then_rl_minus_rl_alone{suffix}_points", versus),
    ):
        ci = f" (paired 95 % CI {low:+.1f} to {high:+.1f})"
        record(name, f"{value:.1f}", suffix=ci, save=save)


if __name__ == "__main__":
    main()
