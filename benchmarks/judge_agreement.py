"""How far a judge agrees with gold: the RAG agent's trajectories judged, against F1 >= 0.9.

    .venv/bin/python benchmarks/judge_agreement.py [--tasks 64] [--modes verdict,rank]
    .venv/bin/python benchmarks/judge_agreement.py --endpoint URL --model NAME --api-key-env VAR

Serves the base model with `lightning-rl serve` (transformers backend, this CPU), samples G = 4
trajectories of the base policy at the training temperature (0.8) on `--tasks` RAG train tasks,
and has the judge score each (judge.endpoint=server: the base model itself judges, through the
same gateway; or any OpenAI-compatible endpoint). Gold is the agent's own reward: an answer
with F1 >= 0.9 (reward 0.1 + 0.9 F1 >= 0.91). This is the calibration a run with a judge makes
before its first iteration (flows/judging.py), on a bigger sample: the same code.

Prints, per judge mode, the agreement, Spearman's rank correlation, the share each side calls
correct, the judge's calls and tokens, and the line `judge_agreement_pct: X` (the first mode's).

    .venv/bin/python benchmarks/judge_agreement.py --quick   # tiny random model, 2 tasks, rank
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from lightning_core.judge.config import JudgeConfig  # noqa: E402
from lightning_core.models import DEFAULT_MODEL, TINY_MODEL  # noqa: E402
from lightning_core.serving.config import ServerConfig  # noqa: E402
from lightning_core.types import Sampling  # noqa: E402
from lightning_rl.agents.rag.data import load_tasks  # noqa: E402
from lightning_rl.flows.profiles import PROFILES  # noqa: E402
from lightning_rl.judge_setup import JudgeSetup, spend  # noqa: E402
from lightning_rl.policy_server import policy_server  # noqa: E402
from lightning_rl.tasks.judging import calibrate_judge  # noqa: E402

GOLD_THRESHOLD = 0.91  # F1 >= 0.9 in 0.1 * format + 0.9 * F1


def _judge(args, mode: str, server_url: str, model: str, key_file: str, folder: Path):
    brief = PROFILES["rag"].judge
    assert brief is not None
    external = args.endpoint is not None
    config = JudgeConfig(
        endpoint=args.endpoint or "server",
        model=args.model,
        api_key_env=args.api_key_env,
        mode=mode,
        max_calls=None,
        max_tokens=None,
    )
    return JudgeSetup(
        config=config,
        rubric=brief.rubric,
        task_fields=brief.task_fields,
        model=args.model if external else model,
        base_url=args.endpoint if external else f"{server_url}/v1",
        key_file=None if external else key_file,
        cache_path=str(folder / f"judge-{mode}.sqlite"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=64, help="RAG train tasks (x4 samples)")
    parser.add_argument("--modes", default="verdict,rank", help="judge modes, comma-separated")
    parser.add_argument("--endpoint", default=None, help="judge endpoint; default: the server")
    parser.add_argument("--model", default=None, help="judge model at --endpoint")
    parser.add_argument("--api-key-env", default=None, help="variable holding its key")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 tasks")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.modes = 2, "rank"
    policy = TINY_MODEL if args.quick else DEFAULT_MODEL
    tasks = random.Random(args.seed).sample(load_tasks("train", 10_000), args.tasks)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        server = ServerConfig(model=policy)
        with policy_server(folder / "store.duckdb", server, tool_format="line") as running:
            for mode in args.modes.split(","):
                setup = _judge(
                    args, mode, running.url, running.base_model, running.key_file, folder
                )
                started = time.perf_counter()
                result = asyncio.run(
                    calibrate_judge.fn(
                        running.url,
                        PROFILES["rag"].agent,
                        tasks,
                        setup,
                        running.base_model,
                        f"calibration-{mode}",
                        Sampling(temperature=0.8),
                        GOLD_THRESHOLD,
                        concurrency=8,
                        rollout_timeout_s=600.0,
                        seed=args.seed,
                        key_file=running.key_file,
                    )
                )
                cost = spend(setup)
                rows.append((mode, setup.model, result, cost, time.perf_counter() - started))
    print(f"\nRAG train tasks: {args.tasks} x 4 trajectories of {policy}, T=0.8; gold: F1 >= 0.9")
    print(
        "| mode | judge | n | agreement % | Spearman | gold correct % | judge correct % "
        "| calls | tokens | minutes |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, judge, r, cost, seconds in rows:
        rho = "n/a" if r.spearman is None else f"{r.spearman:.2f}"
        print(
            f"| {mode} | {judge} | {r.n} | {r.agreement_pct:.1f} | {rho} "
            f"| {r.gold_positive_pct:.1f} | {r.judge_positive_pct:.1f} | {cost.calls} "
            f"| {cost.tokens} | {seconds / 60:.1f} |"
        )
    mode, judge = rows[0][:2]
    # Another first mode or another judge than the base model's verdict is a figure of its own.
    variant = None if (mode, args.endpoint) == ("verdict", None) else f"{mode}, {judge}"
    print()
    record(
        "judge_agreement_pct",
        f"{rows[0][2].agreement_pct:.1f}",
        variant=variant,
        save=not args.quick,
    )


if __name__ == "__main__":
    main()
