"""Ablation on the SQL agent: which calls to train, and with one policy or one per agent.

Three arms with the same budget (the same TrainConfig, `flows/demos/sql.json` unless told
otherwise, and the same seed), each a full `lightning-rl train` run evaluated on the whole
held-out split:

- shared-all:        one shared policy trained on every role's calls (writer, checker, rewriter);
- shared-writer-rw:  one shared policy trained on writer and rewriter calls (the paper's choice);
- per-agent:         one policy per trained agent (writer, rewriter), the checker on the base.

    python benchmarks/ablation_sql.py [--config flows/demos/sql.json] [--arms a,b,c]
        [--reuse ARM=RUN_DIR ...] [--jobs N]

`--jobs 2` trains two arms side by side, each with its CPU share of torch threads, its own
Prefect home and its own MLflow database (under the run folder): the arms never share state,
and their promotions do not compete for one `champion` alias. Each SQL arm's training step
holds several GiB: two at once peaked at 20 GiB in use on a 24 GiB machine, and three (beside
a test run) ran out of memory, the kernel evicting the page cache until the machine stalled.

`--reuse shared-writer-rw=runs/sql-demo-1` takes an arm's figures from a finished run with
that exact config (the demo is that arm) instead of training it again. Prints a markdown table
of base and final accuracy, the gain with its paired 95 % interval, and minutes per arm.

    python benchmarks/ablation_sql.py --quick [--arms ...] [--run-dir DIR]   # the tests run it

--quick trains only the per-agent arm (unless --arms says otherwise; a SQL arm takes about two
minutes even so) with the config's settings but benchmarks/quick_train.py's sizes, which win
over the config: the tiny random model, one iteration of 2 tasks x 2 rollouts, 4 held-out
tasks; into a temporary folder unless --run-dir is given. Its table is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quick_train import (  # noqa: E402
    QUICK_FLAGS,
    run_env,
    run_logged,
    train_command,
)

QUICK_ARMS = "per-agent"
ARMS: dict[str, list[str]] = {
    "shared-all": [
        "--train-agent",
        "writer",
        "--train-agent",
        "checker",
        "--train-agent",
        "rewriter",
        "--shared-policy",
    ],
    "shared-writer-rw": ["--train-agent", "writer", "--train-agent", "rewriter", "--shared-policy"],
    "per-agent": ["--train-agent", "writer", "--train-agent", "rewriter", "--policy-per-agent"],
}


def run_arm(
    arm: str, config: Path, run_dir: Path, threads: int, extra: tuple[str, ...] = ()
) -> dict:
    name = f"ablation-{arm}"
    home = run_dir / f"{name}.state"
    env = run_env(home, OMP_NUM_THREADS=str(threads))
    # This interpreter's own `train`, not a fixed .venv's: the arms run in whatever environment
    # runs the benchmark.
    command = train_command(
        *("--agent", "sql", "--config", str(config)),
        *("--run-dir", str(run_dir), "--run-name", name, "--quiet"),
        *ARMS[arm],
        *extra,
    )
    print(f"[{arm}] {' '.join(command)}", file=sys.stderr, flush=True)
    run_logged(command, env, home / "train.log", f"[{arm}] training", cwd=ROOT)
    return json.loads((run_dir / name / "summary.json").read_text())


def row(arm: str, summary: dict) -> str:
    base, final = summary["base"], summary["final"]
    low, high = summary.get("gain_ci_points", [float("nan")] * 2)
    return (
        f"| {arm} | {base['score']:.1%} | {final['score']:.1%} | "
        f"{summary['gain_points']:+.1f} [{low:+.1f}, {high:+.1f}] | "
        f"{final['mean_reward'] - base['mean_reward']:+.3f} | {summary['minutes']} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "flows" / "demos" / "sql.json")
    parser.add_argument("--arms", default=None, help=f"Comma-separated; default {','.join(ARMS)}")
    parser.add_argument("--run-dir", type=Path, default=None, help="Default: runs")
    parser.add_argument("--reuse", action="append", default=[], metavar="ARM=RUN_DIR")
    parser.add_argument("--jobs", type=int, default=1, help="Arms trained at the same time.")
    parser.add_argument("--quick", action="store_true", help="one arm, short and tiny")
    args = parser.parse_args(argv)
    if args.quick:
        args.arms = args.arms or QUICK_ARMS
        with tempfile.TemporaryDirectory(prefix="ablation-quick-") as tmp:
            args.run_dir = args.run_dir or Path(tmp)
            ablation(parser, args, QUICK_FLAGS)
        return
    args.arms = args.arms or ",".join(ARMS)
    args.run_dir = args.run_dir or ROOT / "runs"
    ablation(parser, args)


def ablation(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extra: tuple[str, ...] = ()
) -> None:
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    reused = dict(item.split("=", 1) for item in args.reuse)
    unknown = [a for a in [*args.arms.split(","), *reused] if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}: use {', '.join(ARMS)}")
    arms = args.arms.split(",")
    trained = [a for a in arms if a not in reused]
    run_dir = args.run_dir.resolve()

    def summary_of(arm: str) -> dict:
        if arm in reused:
            return json.loads((Path(reused[arm]) / "summary.json").read_text())
        # The CPU's share of the arms running beside this one: the last arm runs on all cores.
        beside = min(args.jobs, len(trained) - trained.index(arm))
        threads = max(1, (os.cpu_count() or 1) // beside)
        return run_arm(arm, args.config.resolve(), run_dir, threads, extra)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        summaries = list(pool.map(summary_of, arms))
    rows = [row(arm, summary) for arm, summary in zip(arms, summaries, strict=True)]
    print(f"SQL ablation, config {args.config.name}, held-out execution accuracy (greedy)")
    print("| arm | base | final | gain, points [paired 95 % CI] | mean reward gain | minutes |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
