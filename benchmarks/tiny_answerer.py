"""How reliably the tests' tiny answering model learns its answers: the old recipe against the
one in tests/models.py, on example sets like the judge calibration test's.

Each set is that test's 8 verdict prompts (two questions, gold 1/0/1/0 and 0/1/0/1), with each
agent reply made of 6 random tokens drawn from the set's seed, as a sampling policy on another
machine could have written them; the answer is "yes" or "no" (agreeing with gold, then
disagreeing). A set is learned when greedy decoding gives every answer, as the test checks.

    .venv/bin/python benchmarks/tiny_answerer.py [--sets 6] [--first 0] [--recipes old,new]
                                                 [--prompt tagged|plain]
    .venv/bin/python benchmarks/tiny_answerer.py --quick     # one set, the current recipe

Prints a row per set and recipe, then per recipe: sets learned, failures and mean seconds, and
the line `tiny_answerer_failures: N` (the current recipe's).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from benchmarks.results import record  # noqa: E402
from lightning_core.gateway.chat import encode, render_chat  # noqa: E402
from lightning_core.judge import prompts  # noqa: E402
from lightning_core.models import tiny_model_dir  # noqa: E402
from tests.models import _train_answers  # noqa: E402

RUBRIC = "The reply names a colour."
GROUPS = (("Name a colour.", (1, 0, 1, 0)), ("Name a fruit.", (0, 1, 0, 1)))


def plain_verdict_messages(rubric: str, task: str, transcript: str) -> list[dict[str, str]]:
    """The judge's verdict prompt before issue 43 gave its sections tags (plain f-strings), on
    which the calibration test failed on a fresh clone: the old recipe's failures were measured
    on it."""
    user = (
        f"Rubric: {rubric}\n\nTask:\n{task}\n\nTrajectory:\n{transcript}\n\n"
        "Does the trajectory meet the rubric? Answer yes or no."
    )
    return [
        {"role": "system", "content": prompts.VERDICT_SYSTEM},
        {"role": "user", "content": user},
    ]


PROMPTS = {"tagged": prompts.verdict_messages, "plain": plain_verdict_messages}


def example_set(
    tokenizer, seed: int, agree: bool, prompt: str = "tagged"
) -> list[tuple[list[int], str]]:
    rng = random.Random(seed)
    out = []
    for question, golds in GROUPS:
        for gold in golds:
            reply = tokenizer.decode([rng.randrange(tokenizer.vocab_size) for _ in range(6)])
            transcript = f"user: {question}\nassistant: {reply}"
            messages = PROMPTS[prompt](RUBRIC, f"question: {question}", transcript)
            ids = encode(tokenizer, render_chat(tokenizer, messages))
            out.append((ids, "yes" if (gold == 1) == agree else "no"))
    return out


def old_recipe(folder: Path, examples: list[tuple[list[int], str]], steps: int = 300) -> None:
    """tests/models.py before issue 43: AdamW at 1e-2, stopped on a summed loss under 0.02 per
    example, every position through the head; the same greedy check."""
    shutil.copytree(tiny_model_dir(), folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pairs = [(p, [*encode(tokenizer, text), tokenizer.eos_token_id]) for p, text in examples]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = sum(
            model(input_ids=torch.tensor([p + t]), labels=torch.tensor([[-100] * len(p) + t])).loss
            for p, t in pairs
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.02 * len(pairs):
            break
    model.eval()
    with torch.inference_mode():
        for p, t in pairs:
            out = model.generate(torch.tensor([p]), max_new_tokens=len(t), do_sample=False)
            if out[0, len(p) :].tolist() != t:
                raise RuntimeError("not learned")


RECIPES = {"old": old_recipe, "new": lambda folder, examples: _train_answers(folder, examples, 400)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", type=int, default=6, help="Seeds to try (each: agree, disagree).")
    parser.add_argument("--first", type=int, default=0, help="The first seed.")
    parser.add_argument("--recipes", default="old,new", help="Comma-separated: old, new.")
    parser.add_argument(
        "--prompt",
        choices=sorted(PROMPTS),
        default="tagged",
        help="The judge's verdict prompt: today's (tagged) or before issue 43 (plain).",
    )
    parser.add_argument("--quick", action="store_true", help="One set, the current recipe.")
    args = parser.parse_args()
    if args.quick:
        args.sets, args.recipes = 1, "new"
    # One thread: what is measured is whether each set is learned, and torch's spinning worker
    # threads make a shared 2-core machine many times slower (a test run beside it, say).
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    names = args.recipes.split(",")
    tally = {name: [0, 0, 0.0] for name in names}  # learned, failed, seconds
    print(f"{'recipe':6} {'seed':>4} {'answers':9} {'learned':8} {'seconds':>7}")
    for seed in range(args.first, args.first + args.sets):
        for agree in (True, False):
            examples = example_set(tokenizer, seed, agree, args.prompt)
            for name in names:
                with tempfile.TemporaryDirectory() as folder:
                    start = time.perf_counter()
                    try:
                        RECIPES[name](Path(folder), examples)
                        learned = True
                    except RuntimeError:
                        learned = False
                    seconds = time.perf_counter() - start
                tally[name][0 if learned else 1] += 1
                tally[name][2] += seconds
                answers = "agree" if agree else "disagree"
                print(f"{name:6} {seed:>4} {answers:9} {learned!s:8} {seconds:>7.1f}", flush=True)
    print(f"\n{'recipe':6} {'sets':>5} {'learned':>8} {'failed':>7} {'mean s':>7}")
    for name, (ok, failed, seconds) in tally.items():
        print(f"{name:6} {ok + failed:>5} {ok:>8} {failed:>7} {seconds / (ok + failed):>7.1f}")
    if "new" in tally:
        print()
        variant = None if args.prompt == "tagged" else f"prompt {args.prompt}"
        record("tiny_answerer_failures", tally["new"][1], variant=variant, save=not args.quick)


if __name__ == "__main__":
    main()
