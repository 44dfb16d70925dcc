"""Held-out figures of a rag training run: base vs final, solved rate and mean F1, per tier.

    .venv/bin/python benchmarks/rag_heldout.py [runs/latest] [--by kind] [--split kinds]
    .venv/bin/python benchmarks/rag_heldout.py --quick   # a run of a minute, then its figures

Reads the run's store (the run is over) and prints, per hop count (or per question kind with
`--by kind`) and for all tasks: the solved rate (reward >= 0.9) with Wilson 95 % intervals,
and the mean word-level F1 of the answers, base and final, each gain with its paired bootstrap
95 % interval (tasks resampled with both their outcomes, 10 000 draws, fixed seed).

F1 comes from the episode's reward, 0.1 x format + 0.9 x F1 (agents/rag/reward.py): a reply
without an `ANSWER:` line scores 0 and has no answer, so its F1 is 0.

--quick (the tests run it) first trains the rag agent for one iteration on the tiny random model
into a temporary folder (benchmarks/quick_train.py) and reads that run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.quick_train import train_quick  # noqa: E402
from benchmarks.results import record  # noqa: E402
from lightning_core.stats.comparison import paired_bootstrap  # noqa: E402
from lightning_core.stats.evaluation import wilson_interval  # noqa: E402
from lightning_rl.agents.rag.data import load_tasks  # noqa: E402
from lightning_rl.agents.rag.reward import F1_WEIGHT, FORMAT_WEIGHT  # noqa: E402

SOLVED = 0.9


def f1_of(reward: np.ndarray) -> np.ndarray:
    """Each answer's F1, from its reward (no answer: 0)."""
    return np.where(reward >= FORMAT_WEIGHT, (reward - FORMAT_WEIGHT) / F1_WEIGHT, 0.0)


def load(run: Path, split: str = "test") -> tuple[dict, list[tuple[str, str, str, float, float]]]:
    """The run's summary, and (task id, tier, kind, base reward, final reward) per task of
    held-out `split` (a run with evaluation.extra_splits holds every split it scored)."""
    ids = {t["id"] for t in load_tasks(split, 1_000_000)}
    summary = json.loads((run / "summary.json").read_text())
    base_name, final_name = summary["base"]["policy_version"], summary["final"]["policy_version"]
    with duckdb.connect(str(run / "store.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT task_id, policy_version, coalesce(episode_return, 0), "
            "json_extract_string(input, '$.tier'), json_extract_string(input, '$.kind') "
            "FROM rollouts WHERE mode = 'test' AND policy_version IN (?, ?)",
            [base_name, final_name],
        ).fetchall()
    base = {t: r for t, p, r, _, _ in rows if p == base_name}
    final = {t: r for t, p, r, _, _ in rows if p == final_name}
    meta = {t: (tier, kind) for t, _, _, tier, kind in rows}
    paired = [(t, *meta[t], base[t], final[t]) for t in sorted(set(base) & set(final) & ids)]
    return summary, paired


def row(name: str, base: np.ndarray, final: np.ndarray) -> tuple[str, float, tuple]:
    n = len(base)
    b, f = int((base >= SOLVED).sum()), int((final >= SOLVED).sum())
    bl, bh = wilson_interval(b, n)
    fl, fh = wilson_interval(f, n)
    solved_diff = (final >= SOLVED).astype(float) - (base >= SOLVED).astype(float)
    low, high = paired_bootstrap(solved_diff)
    f1_base, f1_final = f1_of(base), f1_of(final)
    f1_low, f1_high = paired_bootstrap(f1_final - f1_base)
    gain = 100 * float(solved_diff.mean())
    line = (
        f"| {name} | {n} | {b / n:.1%} ({bl:.1%}–{bh:.1%}) | {f / n:.1%} ({fl:.1%}–{fh:.1%}) | "
        f"{gain:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] | {f1_base.mean():.3f} | "
        f"{f1_final.mean():.3f} | {f1_final.mean() - f1_base.mean():+.3f} "
        f"[{f1_low:+.3f}, {f1_high:+.3f}] |"
    )
    return line, gain, (low, high)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, nargs="?", default=Path("runs/latest"))
    parser.add_argument("--by", choices=("tier", "kind"), default="tier")
    parser.add_argument("--split", choices=("test", "kinds"), default="test")
    parser.add_argument("--quick", action="store_true", help="train a tiny run first, read it")
    args = parser.parse_args(argv)
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="rag-heldout-quick-") as tmp:
            run = train_quick("rag", Path(tmp), "rag-quick")
            figures(parser, run, args.by, args.split, save=False)
    else:
        figures(parser, args.run, args.by, args.split)


def figures(
    parser: argparse.ArgumentParser, run: Path, by: str, split: str = "test", save: bool = True
) -> None:
    if not (run / "summary.json").is_file():
        parser.error(f"{run} is not a finished run folder (no summary.json)")
    summary, paired = load(run, split)
    if not paired:
        parser.error(f"{run} holds no held-out rollouts of both policies")
    column = 1 if by == "tier" else 2
    groups = sorted({p[column] for p in paired})
    print(
        f"run {summary['run']}: {len(paired)} held-out tasks of split {split}, "
        f"{summary['minutes']} min"
    )
    print(
        f"| {by} | tasks | base solved | final solved | gain, points [paired 95 % CI] "
        "| base F1 | final F1 | F1 gain [paired 95 % CI] |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for group in [*groups, "all"]:
        chosen = [p for p in paired if group == "all" or p[column] == group]
        base = np.array([p[3] for p in chosen], dtype=float)
        final = np.array([p[4] for p in chosen], dtype=float)
        line, gain, interval = row(group, base, final)
        print(line)
    name = "rag_heldout_gain_points" if split == "test" else f"rag_heldout_{split}_gain_points"
    ci = f" (paired 95 % CI {100 * interval[0]:+.1f} to {100 * interval[1]:+.1f})"
    record(name, f"{gain:.1f}", suffix=ci, save=save)
    three = [p[4] for p in paired if p[1] == "3-hop"]
    if split == "test" and three:
        solved = 100 * float(np.mean(np.array(three) >= SOLVED))
        tasks = f" (final policy, {len(three)} 3-hop tasks)"
        record("rag_multihop_solved_pct", f"{solved:.1f}", suffix=tasks, save=save)


if __name__ == "__main__":
    main()
