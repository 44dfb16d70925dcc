"""Where a finished training run's learning is: the report section `lightning-rl train` writes
(flows/learning.py), made again from the run folder.

    .venv/bin/python benchmarks/learning_report.py [runs/latest]

Prints the held-out score per tier (and per question kind, where tasks have one) at each
evaluation with Wilson 95 % intervals, and the training success per tier rolling over 3
iterations; writes `tier_curves.png` and the CSVs into the run folder, as a run's end does.
For runs made before the report had the section, or to read one again without Prefect.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_core.data import analytics  # noqa: E402
from lightning_rl.flows import learning  # noqa: E402
from lightning_rl.flows.config import TrainConfig  # noqa: E402
from lightning_rl.flows.profiles import profile  # noqa: E402
from lightning_rl.flows.run_context import credit, heldout_tasks, train_tasks  # noqa: E402
from lightning_rl.flows.run_state import load_checkpoint  # noqa: E402


def main(argv: list[str]) -> int:
    run = Path(argv[0] if argv else "runs/latest").resolve()
    checkpoint = load_checkpoint(run)
    if checkpoint is None:
        print(f"{run} has no checkpoint: is it a training run's folder?", file=sys.stderr)
        return 2
    config = TrainConfig.model_validate(json.loads((run / "config.json").read_text()))
    agent = profile(config.agent, config.tasks)
    key, threshold = config.curriculum.tier_key, credit(config, agent).success_threshold
    evals = [(e.iteration, e.restored()) for e in checkpoint.evaluations]
    con = analytics.connect(run, ":memory:")
    try:
        episodes = con.execute("SELECT iteration, task_id, success FROM episodes").df()
    finally:
        con.close()
    train = learning.train_success_by_tier(episodes, train_tasks(config, str(run)), key)
    tests = heldout_tasks(config)
    heldout = learning.heldout_by_group(evals, tests, key, threshold)
    train.to_csv(run / "train_success_by_tier.csv", index=False)
    heldout.to_csv(run / "heldout_by_tier.csv", index=False)
    learning.tier_curves(train, heldout, run / "tier_curves.png", run.name)
    print(f"run {run.name}: held-out score per tier (95 % interval)\n")
    print("\n".join(learning.heldout_table(heldout)))
    if any("kind" in t for t in tests):
        kinds = learning.heldout_by_group(evals, tests, "kind", threshold)
        kinds.to_csv(run / "heldout_by_kind.csv", index=False)
        print("\nper question kind\n")
        print("\n".join(learning.heldout_table(kinds)))
    print(f"\ntraining success per tier, rolling over {learning.WINDOW} iterations\n")
    print("\n".join(learning.train_table(train)))
    print(f"\n(written: {run / 'tier_curves.png'} and the CSVs beside it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
