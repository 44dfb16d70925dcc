"""Arithmetic tasks for the calc agent, with fixed seeds and disjoint train and test splits.

Sources:
- `arithmetic` (generated here): questions with 2 or 3 small integer operands and mixed
  operators, some with parentheses, phrased a few ways; every gold answer is an integer.
- `basic_arithmetic` and `gsm_symbolic` from the `reasoning-gym` package. Its basic_arithmetic
  gold answers are not always right (reasoning-gym 0.1.25), so each one is recomputed from the
  item's expression with our calculator and the item is dropped when they disagree.

A task is a plain dict `{"id", "question", "answer", "source"}`: the agent needs nothing else.
Splits are made disjoint by question text: a test question never appears in train.

`fresh_tasks(size, seed)` makes new arithmetic tasks, as a week of new training data would be:
each seed its own stream, none of them a question of the test or train split. Its `drift` (0 to
1) is the share of *drifted* tasks: 3 or 4 operands of 100 to 999, the operators in words
("What is 412 times 170 minus 305?"), as users whose questions move away from the splits' would
ask (benchmarks/production_drift.py). As a command, it prints them as JSON lines for a task
table:

    python -m lightning_rl.agents.calc.fresh --fresh 200 --seed 1 [--drift 0.5] | \
        lightning-rl data add-tasks runs/data/calc-tasks -
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any, Literal

from lightning_rl.agents.calc.calculator import CalculatorError, evaluate

Source = Literal["arithmetic", "basic_arithmetic", "gsm_symbolic"]
Split = Literal["train", "test"]
SOURCES: tuple[str, ...] = ("arithmetic", "basic_arithmetic", "gsm_symbolic")

# Different seeds per split; the test split is also filtered against train's questions.
_SEEDS = {"train": 1234, "test": 98765}
_PHRASES = ("What is {e}?", "Calculate {e}.", "Compute {e}.", "What is the value of {e}?")


def _generated_expression(rng: random.Random) -> str:
    """2 or 3 operands; division only where it comes out even, so the answer is an integer."""
    terms = rng.choice((2, 3, 3))
    while True:
        nums = [rng.randint(2, 60) for _ in range(terms)]
        ops = [rng.choice("+-*") for _ in range(terms - 1)]
        if terms == 2 and rng.random() < 0.25:
            b = rng.randint(2, 12)
            nums, ops = [b * rng.randint(2, 20), b], ["/"]
        parts = [str(nums[0])]
        for op, n in zip(ops, nums[1:], strict=True):
            parts += [op, str(n)]
        if terms == 3 and rng.random() < 0.4:
            # Parentheses around the first or the last pair change the order of operations.
            if rng.random() < 0.5:
                parts = ["(", *parts[:3], ")", *parts[3:]]
            else:
                parts = [*parts[:2], "(", *parts[2:], ")"]
        expression = " ".join(parts).replace("( ", "(").replace(" )", ")")
        value = evaluate(expression)
        if float(value).is_integer() and abs(value) < 10_000:
            return expression


# Operators as users write them in words: the splits only ever show the symbols.
_SPOKEN = {"+": "plus", "-": "minus", "*": "times"}


def _drifted_expression(rng: random.Random) -> str:
    """3 or 4 operands of 100-999 with + - * (no parentheses: in words they would be
    ambiguous); asked in words (`_spoken`), so the agent must write the calculator's expression
    itself rather than copy it: what the week-0 champion never saw. Never a split's question
    (those use symbols and operands of at most 60)."""
    terms = rng.choice((3, 4))
    while True:
        nums = [rng.randint(100, 999) for _ in range(terms)]
        ops = [rng.choice("+-*") for _ in range(terms - 1)]
        parts = [str(nums[0])]
        for op, n in zip(ops, nums[1:], strict=True):
            parts += [op, str(n)]
        expression = " ".join(parts)
        # Two products of 3-digit numbers stay below 10**9; a bound keeps answers readable.
        if abs(evaluate(expression)) < 10**7:
            return expression


def _spoken(expression: str) -> str:
    """`_drifted_expression`'s expression in words: "120 * 7 - 3" -> "120 times 7 minus 3"."""
    return " ".join(_SPOKEN.get(part, part) for part in expression.split())


def _arithmetic(split: Split, size: int) -> list[dict[str, Any]]:
    rng = random.Random(_SEEDS[split])
    tasks = []
    for _ in range(size):
        expression = _generated_expression(rng)
        question = rng.choice(_PHRASES).format(e=expression)
        tasks.append({"question": question, "answer": int(evaluate(expression))})
    return tasks


def _reasoning_gym(source: Source, split: Split, size: int) -> list[dict[str, Any]]:
    import reasoning_gym

    options: dict[str, Any] = {}
    if source == "basic_arithmetic":
        options = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    # Ask for more than needed: some items are dropped below.
    dataset = reasoning_gym.create_dataset(source, size=size * 2, seed=_SEEDS[split], **options)
    tasks = []
    for item in dataset:
        answer = _number(item["answer"])
        if answer is None:
            continue
        expression = item.get("metadata", {}).get("expression")
        if source == "basic_arithmetic":
            try:
                if expression is None or abs(evaluate(expression) - answer) > 1e-9:
                    continue
            except CalculatorError:
                continue
        tasks.append({"question": item["question"], "answer": answer})
        if len(tasks) == size:
            break
    return tasks


def _number(text: Any) -> int | float | None:
    try:
        value = float(str(text).replace(",", ""))
    except ValueError:
        return None
    return int(value) if value.is_integer() else value


def load_tasks(split: Split, size: int, source: Source = "arithmetic") -> list[dict[str, Any]]:
    """`size` tasks of `source` for `split`, the same every time."""
    if split not in _SEEDS:
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {source!r}")
    if size < 1:
        raise ValueError(f"size must be at least 1, not {size}")
    make = _arithmetic if source == "arithmetic" else lambda s, n: _reasoning_gym(source, s, n)
    if split == "train":
        items = make("train", size)
    else:
        # Disjoint from any train set of up to 4x this size: drop questions train also has.
        seen = {t["question"] for t in make("train", size * 4)}
        items = [t for t in make("test", size * 2) if t["question"] not in seen][:size]
    return [
        {"id": f"{source}-{split}-{i}", **item, "source": source} for i, item in enumerate(items)
    ]


# Fresh tasks stay clear of every test split of up to this size and every train split of up to
# FRESH_TRAIN_GUARD (the train split's default is 2000).
FRESH_TEST_GUARD = 1000
FRESH_TRAIN_GUARD = 2000


def fresh_tasks(size: int, seed: int, drift: float = 0.0) -> list[dict[str, Any]]:
    """`size` new arithmetic tasks, the same for the same seed (and drift), never a test or
    train question; a share `drift` of them drifted (`_drifted_expression`, source
    `arithmetic-drift`)."""
    if size < 1:
        raise ValueError(f"size must be at least 1, not {size}")
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drift must be between 0 and 1, not {drift}")
    # load_tasks("test", n) draws from the first 2n items of the test stream, and train from
    # the first n of its own: excluding those prefixes covers every split up to the guards.
    taken = {t["question"] for t in _arithmetic("test", 2 * FRESH_TEST_GUARD)}
    taken |= {t["question"] for t in _arithmetic("train", FRESH_TRAIN_GUARD)}
    # A string seed picks a stream of its own, apart from the splits' integer seeds.
    rng = random.Random(f"calc-fresh-{seed}")
    # Its own stream decides which tasks drift, so that drift=0 keeps the stream it always had.
    drifts = random.Random(f"calc-drift-{seed}")
    tasks: list[dict[str, Any]] = []
    while len(tasks) < size:
        drifted = drift > 0 and drifts.random() < drift
        expression = _drifted_expression(rng) if drifted else _generated_expression(rng)
        question = rng.choice(_PHRASES).format(e=_spoken(expression) if drifted else expression)
        if question in taken:
            continue
        taken.add(question)
        tasks.append(
            {
                "id": f"arithmetic-fresh{seed}-{len(tasks)}",
                "question": question,
                "answer": int(evaluate(expression)),
                "source": "arithmetic-drift" if drifted else "arithmetic",
            }
        )
    return tasks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_rl.agents.calc.fresh",
        description="Print new arithmetic tasks as JSON lines (for `lightning-rl data add-tasks`).",
    )
    parser.add_argument("--fresh", type=int, required=True, metavar="N", help="tasks to make")
    parser.add_argument("--seed", type=int, default=0, help="stream of tasks (one per week, say)")
    parser.add_argument(
        "--drift", type=float, default=0.0, help="share of drifted tasks (operators in words)"
    )
    args = parser.parse_args(argv)
    if args.fresh < 1:
        parser.error(f"--fresh must be at least 1, not {args.fresh}")
    if not 0.0 <= args.drift <= 1.0:
        parser.error(f"--drift must be between 0 and 1, not {args.drift}")
    for task in fresh_tasks(args.fresh, args.seed, args.drift):
        sys.stdout.write(json.dumps(task) + "\n")
