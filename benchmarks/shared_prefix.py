"""One LoRA update on a finished run's own training batches, with shared prefixes and without.

For each of a run's iterations (`--iterations`, default all), the transitions that iteration
trained on (the run's store, advantage not 0) are one `LoRATrainer.step` of SmolLM2-135M with
the run's adapter settings (rank, alpha, top layers), once with `trainer.prefix_share` on and
once off, each from the same fresh adapter after one warm-up step of its own: the tokens the
forward passes compute (prompt + response of every row, the shared prefix of a micro-batch
once) and the seconds of the timed step. Both arms merge prefixes (prefix.py), as the
trainer's default does, so the difference is the shared prefixes alone; the updates are equal
(tests/test_shared_prefix.py). Prints a row per iteration, the totals, and

    shared_prefix_tokens_saved_frac: X      (of the tokens the unshared update computes)
    shared_prefix_step_speedup: X           (unshared seconds / shared seconds)

    .venv/bin/python benchmarks/shared_prefix.py runs/<run> [--iterations 1,2] [--steps 1]
    .venv/bin/python benchmarks/shared_prefix.py --quick     # the tiny model (the tests)

--every-call: all of an iteration's calls, not only those with a signal.

--quick: the tiny random model on a synthetic batch (4 tasks x a group of 4, one system
prompt): it checks the code path, and its figures say nothing of SmolLM2's. Run it alone on a
quiet machine: the step times are wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from lightning_core.algo.config import TrainerConfig  # noqa: E402
from lightning_core.algo.shared_prefix import forward_tokens, shared_length  # noqa: E402
from lightning_core.algo.trainer import LoRATrainer  # noqa: E402
from lightning_core.data.analytics import connect  # noqa: E402
from lightning_core.models import tiny_model_dir  # noqa: E402
from lightning_core.store.config import StoreConfig  # noqa: E402
from lightning_core.store.duckdb_store import DuckDBStore  # noqa: E402
from lightning_core.types import Transition  # noqa: E402


def run_batches(run: Path, every_call: bool = False) -> dict[int, list[Transition]]:
    """Iteration -> the transitions it trained on (advantage not 0; with `every_call`, all its
    calls), from the run's store."""
    if not (run / "store.duckdb").is_file():
        sys.exit(f"{run} has no store.duckdb: give a training run's folder (runs/<run>)")

    # The run's exported transitions (analytics) say which iteration trained each rollout.
    with contextlib.closing(connect(run, database=":memory:")) as con:
        pairs = con.execute("SELECT DISTINCT rollout_id, iteration FROM transitions").fetchall()
    iteration_of = {rollout: int(iteration) for rollout, iteration in pairs}

    async def read() -> dict[int, list[Transition]]:
        store = DuckDBStore(StoreConfig(db=str(run / "store.duckdb")))
        try:
            batches: dict[int, list[Transition]] = {}
            for t in await store.query_transitions(list(iteration_of)):
                if t.advantage or (every_call and t.advantage is not None):
                    batches.setdefault(iteration_of[t.rollout_id], []).append(t)
            return dict(sorted(batches.items()))
        finally:
            await store.close()

    return asyncio.run(read())


def trainer_config(run: Path | None, share: bool) -> TrainerConfig:
    """The run's trainer settings with prefix sharing on or off; the tiny model without a run."""
    if run is None:
        return TrainerConfig(model=str(tiny_model_dir()), prefix_share=share)
    trainer = json.loads((run / "config.json").read_text())["trainer"]
    return TrainerConfig.model_validate(trainer | {"prefix_share": share})


def computed_tokens(trainer: LoRATrainer, batch: list[Transition]) -> int:
    """Tokens the update's forward passes compute, padding aside (what the trainer counts)."""
    micros = trainer._micro_batches(trainer._rows(batch, trainer.config.prefix_merge))
    sharing = trainer._sharing()
    return sum(forward_tokens(m, shared_length(m) if sharing else 0) for m in micros)


def timed(config: TrainerConfig, batch: list[Transition], steps: int) -> tuple[int, float]:
    """(computed tokens, mean seconds of `steps` updates after a warm-up one)."""
    trainer = LoRATrainer(config)
    trainer.step(batch)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.step(batch)
    return computed_tokens(trainer, batch), (time.perf_counter() - started) / steps


def synthetic(vocab: int) -> dict[int, list[Transition]]:
    """4 tasks x a group of 4 single calls: a 64-token system prompt, a 24-token question."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system, batch = ids(64), []
    for task in range(4):
        prompt = system + ids(24)
        for g in range(4):
            response = ids(8)
            batch.append(
                Transition(
                    rollout_id=f"t{task}-r{g}",
                    step=0,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_logprobs=[-5.0] * len(response),
                    advantage=1.0 if g % 2 else -1.0,
                )
            )
    return {1: batch}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", nargs="?", type=Path, help="a training run's folder")
    parser.add_argument("--iterations", default=None, help="comma-separated; default: all")
    parser.add_argument("--steps", type=int, default=1, help="timed steps after a warm-up")
    parser.add_argument(
        "--every-call",
        action="store_true",
        help="every call of an iteration, also those without a signal (a run that had none, "
        "as the tests' tiny random model's)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, synthetic batch")
    args = parser.parse_args(argv)
    if args.run is None and not args.quick:
        parser.error("give a run folder, or --quick")
    run = None if args.quick else args.run.resolve()
    if run is None:
        batches = synthetic(LoRATrainer(trainer_config(None, True)).model.config.vocab_size)
    else:
        batches = run_batches(run, args.every_call)
    if args.iterations:
        wanted = {int(k) for k in args.iterations.split(",")}
        batches = {k: v for k, v in batches.items() if k in wanted}
    if not batches:
        sys.exit("no iteration with trained transitions found")
    print(f"shared prefixes on {run or 'a synthetic batch (tiny model)'}", flush=True)
    columns = ["iteration", "calls", "tokens, unshared", "tokens, shared"]
    columns += ["s/step, unshared", "s/step, shared"]
    print("| " + " | ".join(columns) + " |")
    print("|---:|---:|---:|---:|---:|---:|")
    totals = [0, 0, 0.0, 0.0]
    for k, batch in batches.items():
        apart, apart_s = timed(trainer_config(run, False), batch, args.steps)
        shared, shared_s = timed(trainer_config(run, True), batch, args.steps)
        totals = [totals[0] + apart, totals[1] + shared, totals[2] + apart_s, totals[3] + shared_s]
        print(f"| {k} | {len(batch)} | {apart} | {shared} | {apart_s:.2f} | {shared_s:.2f} |")
        sys.stdout.flush()
    print(f"| all | | {totals[0]} | {totals[1]} | {totals[2]:.1f} | {totals[3]:.1f} |")
    save = not args.quick
    record("shared_prefix_tokens_saved_frac", f"{1 - totals[1] / totals[0]:.3f}", save=save)
    record("shared_prefix_step_speedup", f"{totals[2] / totals[3]:.2f}", save=save)


if __name__ == "__main__":
    main()
