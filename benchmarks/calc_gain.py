"""Held-out gain of a training run, per task: base vs final policy on the same test tasks.

    .venv/bin/python benchmarks/calc_gain.py [runs/latest]
    .venv/bin/python benchmarks/calc_gain.py --quick   # a run of a minute, then its figures

Reads the run's store (stop nothing: the run is over) and prints both accuracies with Wilson
95 % intervals, the gain in points with a paired bootstrap 95 % interval (tasks resampled,
10 000 draws, fixed seed), and how many tasks were newly solved or lost. --quick (the tests run
it) first trains the calc agent for one iteration on the tiny random model into a temporary
folder (benchmarks/quick_train.py) and reads that run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

from benchmarks.quick_train import train_quick  # noqa: E402
from benchmarks.results import record  # noqa: E402
from lightning_core.stats.evaluation import wilson_interval  # noqa: E402


def figures(run: Path, save: bool = True) -> None:
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
    scores, intervals = [], []
    for name, outcome in ((base_name, base), (final_name, final)):
        k = sum(outcome[t] for t in tasks)
        low, high = wilson_interval(k, len(tasks))
        scores.append(f"{100 * k / len(tasks):.1f}")
        intervals.append(f"{100 * low:.1f} to {100 * high:.1f}")
        print(f"| {name} | {k / len(tasks):.1%} | {low:.1%} - {high:.1%} |")
    gain = 100 * sum(diffs) / len(diffs)
    ci = f"{draws[250]:+.1f} to {draws[9750]:+.1f}"
    print(f"gain: {gain:+.1f} points, paired bootstrap 95 % CI {ci}")
    print(f"newly solved {diffs.count(1)}, lost {diffs.count(-1)}, unchanged {diffs.count(0)}")
    record("calc_heldout_gain_points", f"{gain:.1f}", save=save)
    # Kept beside the gain, for README's result; the table above already printed them.
    kept = ("base_pct", "final_pct", "base_ci", "final_ci", "gain_ci")
    for name, value in zip(kept, (*scores, *intervals, ci), strict=True):
        record(f"calc_heldout_{name}", value, echo=False, save=save)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, nargs="?", default=Path("runs/latest"))
    parser.add_argument("--quick", action="store_true", help="train a tiny run first, read it")
    args = parser.parse_args(argv)
    if not args.quick:
        figures(args.run)
        return
    with tempfile.TemporaryDirectory(prefix="calc-gain-quick-") as tmp:
        figures(train_quick("calc", Path(tmp), "calc-quick"), save=False)


if __name__ == "__main__":
    main()
