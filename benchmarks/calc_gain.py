"""Held-out gain of a training run, per task: base vs final policy on the same test tasks.

    .venv/bin/python benchmarks/calc_gain.py [runs/latest]

Reads the run's store (stop nothing: the run is over) and prints both accuracies with Wilson
95 % intervals, the gain in points with a paired bootstrap 95 % interval (tasks resampled,
10 000 draws, fixed seed), and how many tasks were newly solved or lost.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import duckdb

from lightning_core.evaluation import wilson_interval


def main(run: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    base_name, final_name = summary["base"]["policy_version"], summary["final"]["policy_version"]
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT task_id, policy_version, coalesce(episode_return, 0) FROM rollouts "
            "WHERE mode = 'test' AND policy_version IN (?, ?)",
            [base_name, final_name],
        ).fetchall()
    base = {t: r >= 1.0 for t, p, r in rows if p == base_name}
    final = {t: r >= 1.0 for t, p, r in rows if p == final_name}
    tasks = sorted(set(base) & set(final))
    diffs = [int(final[t]) - int(base[t]) for t in tasks]
    rng = random.Random(0)
    draws = sorted(
        100 * sum(diffs[rng.randrange(len(diffs))] for _ in diffs) / len(diffs)
        for _ in range(10_000)
    )
    print(f"run {summary['run']}: {len(tasks)} held-out tasks, {summary['minutes']} min")
    print("| policy | accuracy | 95 % CI (Wilson) |")
    print("|---|---|---|")
    for name, outcome in ((base_name, base), (final_name, final)):
        k = sum(outcome[t] for t in tasks)
        low, high = wilson_interval(k, len(tasks))
        print(f"| {name} | {k / len(tasks):.1%} | {low:.1%} - {high:.1%} |")
    gain = 100 * sum(diffs) / len(diffs)
    print(
        f"gain: {gain:+.1f} points, "
        f"paired bootstrap 95 % CI {draws[250]:+.1f} to {draws[9750]:+.1f}"
    )
    print(f"newly solved {diffs.count(1)}, lost {diffs.count(-1)}, unchanged {diffs.count(0)}")
    print(f"calc_heldout_gain_points: {gain:.1f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/latest"))
