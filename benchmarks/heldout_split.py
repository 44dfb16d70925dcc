"""A registered policy against the base model on one held-out split, task by task.

    .venv/bin/python benchmarks/heldout_split.py --agent sql --split kinds [--policy champion]
    .venv/bin/python benchmarks/heldout_split.py --agent rag --split kinds --policy 3

Runs the Prefect flow `evaluate` (what `lightning-rl eval` runs) twice on the same tasks of
`--split`, once for the base model and once for `--policy` (an alias or a version number of the
agent's registered model, default registry), then compares them as a training run's end does
(lightning_core.stats.comparison.compare): solved rate per tier with Wilson intervals and the
paired bootstrap 95 % interval of the gain. Prints the table and
`<agent>_heldout_<split>_gain_points: X`.

For a run trained before its agent had the split (`evaluation.extra_splits` scores it inside a
run from then on): the same policy, the same measure, taken afterwards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from lightning_core.stats.comparison import Comparison, compare  # noqa: E402
from lightning_core.stats.evaluation import EvalResult  # noqa: E402


def _result(summary: dict) -> EvalResult:
    return EvalResult.model_validate(summary).model_copy(update={"rewards": summary["rewards"]})


def compare_split(
    agent: str,
    split: str,
    policy: str,
    eval_size: int,
    run_dir: str,
    tasks: str | None = None,
    model: str | None = None,
    registry: Any = None,
) -> tuple[Comparison, dict[str, Any]]:
    """The base model and `policy` on the same tasks of `split` (two runs of the flow
    `evaluate`, whose Prefect API the caller provides), compared task by task; and the policy's
    evaluation summary."""
    from lightning_rl.flows.evaluate import evaluate
    from lightning_rl.flows.profiles import profile

    spec = profile(agent, tasks)
    found = {
        name: evaluate(
            agent=agent,
            tasks=tasks,
            policy=name,
            eval_size=eval_size,
            split=split,
            model=model,
            run_dir=run_dir,
            registry=registry,
        )
        for name in ("base", policy)
    }
    base, final = _result(found["base"]), _result(found[policy])
    tasks_of_split = spec.load_tasks(split, eval_size)
    return compare(base, final, tasks_of_split, "tier", spec.success_threshold, 0), found[policy]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", default="sql")
    parser.add_argument("--split", default="kinds")
    parser.add_argument("--policy", default="champion", help="alias or version number")
    parser.add_argument("--eval-size", type=int, default=1000)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args()

    from lightning_rl.flows.cli.common import quiet_prefect
    from lightning_rl.flows.prefect_server import temporary_server

    quiet_prefect()
    with temporary_server():
        comparison, found = compare_split(
            args.agent, args.split, args.policy, args.eval_size, args.run_dir
        )
    print(f"{args.agent}, split {args.split}: base vs {args.policy} (version {found['version']})")
    print(comparison.markdown())
    record(f"{args.agent}_heldout_{args.split}_gain_points", comparison.gain_points)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
