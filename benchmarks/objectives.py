"""Ablation of the policy-gradient objectives on the calc demo: one run per arm, same seed.

Every arm is `lightning-rl train --agent calc` (the demo: 12 iterations, 16 tasks x 4
rollouts, 200 held-out tasks evaluated every 4 iterations) with the same seed, and only the
objective changed (lightning_core/algo/losses.py, docs/lightningrl.md):

- default:       the trainer's defaults (token-mean PPO-clip with clip-higher, no std
                 normalisation of advantages, prefix merging on);
- grpo:          GRPO as published: advantages divided by the group's std, seq-mean-token-mean;
- dr-grpo:       Dr. GRPO: no std, no per-call length division (seq-mean-token-sum-norm, C =
                 the demo's max_tokens);
- gspo:          GSPO's sequence-level ratio and clip (3e-4 / 4e-4), seq-mean-token-mean;
- ratio-mask:    IcePop-style masking of tokens whose behaviour ratio is outside [1/2, 2];
- overlong:      calls cut at their token limit leave the loss;
- rollout-mean:  every rollout weighs the same, whatever its number of calls and tokens;
- seq-mean:      every call weighs the same (seq-mean-token-mean), the default otherwise;
- no-merge:      the default with prefix merging off (same update; time only).

    python benchmarks/objectives.py [--arms a,b] [--run-dir runs] [--reuse ARM=RUN_DIR ...]
    python benchmarks/objectives.py --quick [--arms a,b]     # the tests run it

Per arm it prints the minutes from the run's start to the first held-out evaluation at least
20 points above the base ('-' when none is), the final gain with its paired 95 % interval, and
the run's minutes; then `calc_minutes_to_20: X` for the default arm (nan when it never got
there). A full run is one demo per arm (17 min each on 2 cores: docs/benchmarks-history.md):
run it alone.

--quick trains each arm (default: default and gspo) as benchmarks/quick_train.py does (the tiny
random model, one iteration of 2 tasks x 2 rollouts, 4 held-out tasks, about a minute an arm)
into a temporary folder unless --run-dir is given. Its figures are noise: the random model earns
the same reward in every rollout of a group, so no arm's update has a signal; what it checks is
that every arm's settings reach its run and the table is read from real run folders.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.quick_train import QUICK_FLAGS, run_env, run_logged, train_command  # noqa: E402
from benchmarks.results import record  # noqa: E402
from lightning_core.stats.comparison import paired_bootstrap  # noqa: E402

# The calc agent's generation budget (agents/calc/agent.py MAX_TOKENS): Dr. GRPO's constant.
DEMO_MAX_TOKENS = 48
TARGET_POINTS = 20.0
QUICK_ARMS = "default,gspo"
# Per arm, the --trainer and --credit settings it changes (merged over the demo's).
ARMS: dict[str, dict[str, dict[str, Any]]] = {
    "default": {},
    "grpo": {
        "trainer": {"aggregation": "seq-mean-token-mean"},
        "credit": {"normalize_std": True},
    },
    "dr-grpo": {
        "trainer": {"aggregation": "seq-mean-token-sum-norm", "loss_norm_tokens": DEMO_MAX_TOKENS},
        "credit": {"normalize_std": False},
    },
    "gspo": {
        "trainer": {
            "importance_ratio": "sequence",
            "clip_low": 3e-4,
            "clip_high": 4e-4,
            "aggregation": "seq-mean-token-mean",
        }
    },
    "ratio-mask": {"trainer": {"ratio_mask": 2.0}},
    "overlong": {"trainer": {"overlong_filter": True}},
    "rollout-mean": {"trainer": {"aggregation": "rollout-mean"}},
    "seq-mean": {"trainer": {"aggregation": "seq-mean-token-mean"}},
    "no-merge": {"trainer": {"prefix_merge": False}},
}


def arm_flags(arm: str) -> list[str]:
    return [f for section, v in ARMS[arm].items() for f in (f"--{section}", json.dumps(v))]


def run_arm(arm: str, run_dir: Path, extra: tuple[str, ...]) -> Path:
    name = f"objectives-{arm}"
    home = run_dir / f"{name}.state"
    command = train_command(
        *("--agent", "calc", "--seed", "0", "--run-dir", str(run_dir), "--run-name", name),
        "--quiet",
        *arm_flags(arm),
        *extra,
    )
    print(f"[{arm}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    run_logged(command, run_env(home), home / "train.log", f"[{arm}] training", cwd=ROOT)
    return run_dir / name


def measure(run: Path) -> dict[str, Any]:
    """Minutes to +20 held-out points (nan: never), final gain and interval, minutes, the
    held-out score at each evaluation and the final policy's reward per task."""
    summary = json.loads((run / "summary.json").read_text())
    evaluations = json.loads((run / "checkpoint.json").read_text())["evaluations"]
    events = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    start = next(e["time"] for e in events if e["stage"] == "start")
    evaluated = [e for e in events if e["stage"] == "evaluated"]
    base = next(e["score"] for e in evaluated if e["iteration"] == 0)
    reached = [e["time"] for e in evaluated if 100 * (e["score"] - base) >= TARGET_POINTS - 1e-9]
    return {
        "minutes_to_20": (reached[0] - start) / 60 if reached else math.nan,
        "gain": summary["gain_points"],
        "gain_ci": summary.get("gain_ci_points", [math.nan, math.nan]),
        "minutes": summary["minutes"],
        "curve": {e["iteration"]: e["score"] for e in evaluated},
        "rewards": evaluations[-1]["rewards"],
    }


def versus(rewards: dict[str, float], reference: dict[str, float]) -> str:
    """An arm's final policy against the reference arm's, task by task: the difference in
    solved held-out tasks, points, with its paired bootstrap 95 % interval."""
    tasks = sorted(reference)
    diffs = np.array([float(rewards[t] >= 1.0) - float(reference[t] >= 1.0) for t in tasks])
    low, high = paired_bootstrap(diffs)
    return f"{100 * diffs.mean():+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def report(results: dict[str, dict[str, Any]], save: bool = True) -> None:
    print("calc objectives ablation, held-out accuracy (greedy), same seed")
    columns = ["arm", "minutes to +20 points", "final gain, points [paired 95 % CI]"]
    columns += ["held-out at each evaluation", "final vs default [paired 95 % CI]", "minutes"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---:|---:|---|---:|---:|")
    reference = results.get("default")
    for arm, r in results.items():
        to_20 = "-" if math.isnan(r["minutes_to_20"]) else f"{r['minutes_to_20']:.1f}"
        low, high = r["gain_ci"]
        curve = " / ".join(f"{100 * score:.1f}" for _, score in sorted(r["curve"].items()))
        against = "" if reference is None else versus(r["rewards"], reference["rewards"])
        print(
            f"| {arm} | {to_20} | {r['gain']:+.1f} [{low:+.1f}, {high:+.1f}] | {curve} "
            f"| {against} | {r['minutes']} |"
        )
    if "default" in results:
        minutes = f"{results['default']['minutes_to_20']:.1f}"
        record("calc_minutes_to_20", minutes, save=save)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default=None, help=f"Comma-separated; default {','.join(ARMS)}")
    parser.add_argument("--run-dir", type=Path, default=None, help="Default: runs")
    parser.add_argument("--reuse", action="append", default=[], metavar="ARM=RUN_DIR")
    parser.add_argument("--quick", action="store_true", help="tiny and short arms")
    args = parser.parse_args(argv)
    arms = (args.arms or (QUICK_ARMS if args.quick else ",".join(ARMS))).split(",")
    reused = dict(item.split("=", 1) for item in args.reuse)
    unknown = [a for a in [*arms, *reused] if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}: use {', '.join(ARMS)}")
    with tempfile.TemporaryDirectory(prefix="objectives-quick-") as tmp:
        run_dir = (args.run_dir or (Path(tmp) if args.quick else ROOT / "runs")).resolve()
        extra = QUICK_FLAGS if args.quick else ()
        results = {
            arm: measure(Path(reused[arm]) if arm in reused else run_arm(arm, run_dir, extra))
            for arm in arms
        }
    report(results, save=not args.quick)


if __name__ == "__main__":
    main()
