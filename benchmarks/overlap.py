"""What concurrent rollouts and training buy: the calc demo with staleness 0 and 1.

    .venv/bin/python benchmarks/overlap.py --train            # both runs, one after the other
    .venv/bin/python benchmarks/overlap.py runs/A runs/B       # the table of two finished runs
    .venv/bin/python benchmarks/overlap.py --quick   # both runs short and tiny (the tests)

With --train it runs `lightning-rl train --agent calc --staleness S --run-name overlap-sS` for
S = 0 then 1 (the demo's defaults otherwise: 12 iterations, 16 tasks x 4 rollouts, the 200
held-out tasks), nothing else running, and then prints the table. Each run's wall time is from
its progress file's first event ("start", before the policy server starts) to its last ("done",
after registration), so it counts the base and final evaluations as well as the iterations; the
iterations alone are the time from the base evaluation to the last iteration's end. The gain
is final minus base on the same held-out tasks, with the paired bootstrap interval the run
computed (heldout_comparison.json).

Prints `overlap_speedup: X`, the staleness-0 run's wall time over the staleness-1 run's.

--quick trains both runs as benchmarks/quick_train.py does (the tiny random model, 2 tasks x 2
rollouts, 4 held-out tasks) but for 2 iterations, the fewest in which staleness 1 overlaps one
iteration's rollouts with the previous one's update, into a temporary folder unless --run-dir is
given, each with a Prefect home and MLflow database of its own; its speedup is noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.quick_train import train_quick  # noqa: E402
from benchmarks.results import record  # noqa: E402


def _events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]


def measure(run: Path) -> dict[str, Any]:
    """The figures of one finished run folder."""
    summary = json.loads((run / "summary.json").read_text())
    config = json.loads((run / "config.json").read_text())
    events = _events(run)
    start = next(e["time"] for e in events if e["stage"] == "start")
    done = [e["time"] for e in events if e["stage"] == "done"][-1]
    base_eval = next(e["time"] for e in events if e["stage"] == "evaluated")
    last_iteration = [e["time"] for e in events if e["stage"] == "iterated"][-1]
    history = json.loads((run / "checkpoint.json").read_text())["history"]

    def avg(key: str) -> float:
        values = [m[key] for m in history if key in m]
        return mean(values) if values else float("nan")

    return {
        "run": run.name,
        # In its section since issue 26; flat in the config.json of earlier runs.
        "staleness": config.get("rollouts", {}).get("staleness", config.get("staleness", 0)),
        "wall_min": (done - start) / 60,
        "iterations_min": (last_iteration - base_eval) / 60,
        "base": summary["base"]["score"],
        "final": summary["final"]["score"],
        "gain": summary["gain_points"],
        "gain_ci": summary["gain_ci_points"],
        "staleness_mean": avg("train/staleness_mean"),
        "trainer_wait_s": avg("pipeline/trainer_wait_s"),
        "is_ratio_max": max((m.get("train/is_ratio_max", 1.0) for m in history), default=1.0),
        "reward_last3": mean(m["rollout/reward_mean"] for m in history[-3:]),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | staleness | wall (min) | iterations (min) | held-out base -> final | gain "
        "(points, 95 % CI) | mean staleness | trainer wait / iteration (s) | max IS ratio | "
        "train reward, last 3 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["gain_ci"]
        lines.append(
            f"| {r['run']} | {r['staleness']} | {r['wall_min']:.1f} | {r['iterations_min']:.1f} "
            f"| {r['base']:.1%} -> {r['final']:.1%} | {r['gain']:+.1f} ({low:+.1f} to "
            f"{high:+.1f}) | {r['staleness_mean']:.2f} | {r['trainer_wait_s']:.1f} | "
            f"{r['is_ratio_max']:.2f} | {r['reward_last3']:.3f} |"
        )
    return "\n".join(lines)


def _train(staleness: int, run_dir: str) -> Path:
    name = f"overlap-s{staleness}"
    command = [
        str(Path(sys.executable).with_name("lightning-rl")),
        "train",
        "--agent",
        "calc",
        "--staleness",
        str(staleness),
        "--run-name",
        name,
        "--run-dir",
        run_dir,
    ]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return Path(run_dir) / name


def _train_quick(staleness: int, run_dir: str) -> Path:
    flags = ("--iterations", "2", "--eval-every", "2", "--staleness", str(staleness))
    return train_quick("calc", Path(run_dir), f"overlap-s{staleness}", *flags)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="Finished run folders to compare.")
    parser.add_argument("--train", action="store_true", help="Run the demo at staleness 0 and 1.")
    parser.add_argument("--run-dir", default=None, help="Folder of the --train runs (runs).")
    parser.add_argument("--quick", action="store_true", help="--train, short and tiny")
    args = parser.parse_args(argv)
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="overlap-quick-") as tmp:
            report([_train_quick(s, args.run_dir or tmp) for s in (0, 1)], save=False)
        return
    runs = [_train(s, args.run_dir or "runs") for s in (0, 1)] if args.train else args.runs
    if len(runs) != 2:
        parser.error("give two run folders (staleness 0, then 1), or --train")
    report(runs)


def report(runs: list[Path], save: bool = True) -> None:
    rows = sorted((measure(r) for r in runs), key=lambda r: r["staleness"])
    print(table(rows))
    slow, fast = rows[0], rows[-1]
    record("overlap_speedup", f"{slow['wall_min'] / fast['wall_min']:.2f}", save=save)
    speedup = slow["iterations_min"] / fast["iterations_min"]
    record("iterations_speedup", f"{speedup:.2f}", save=save)
    for r in rows:
        record(f"heldout_gain_points_staleness_{r['staleness']}", f"{r['gain']:.1f}", save=save)


if __name__ == "__main__":
    main()
