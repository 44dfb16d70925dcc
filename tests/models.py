"""Real models for tests: the tiny random Llama, and a copy taught to call a tool.

A random model never writes a tool call, so the tool round trip is tested with a tiny model that
was trained (a few seconds of AdamW on one example) to answer one tools prompt with one call.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import orjson
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_core.gateway.chat import encode, render_chat
from lightning_core.models import _building, cache_dir, tiny_model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
TOOL_QUESTION = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
TOOL_CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def tool_calling_model(steps: int = 400) -> Path:
    """The tiny model, trained to answer TOOL_QUESTION (with TOOLS) by calling `add`; built
    once into the cache."""
    # "-v2": the recipe of _train_answers; a model an older recipe left in the cache is not reused.
    target_dir = cache_dir() / "models" / "tiny-tool-caller-v2"
    with _building(target_dir) as scratch:
        if scratch is not None:
            _train_tool_call(scratch, steps)
    return target_dir


def _train_tool_call(folder: Path, steps: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    prompt = encode(tokenizer, render_chat(tokenizer, TOOL_QUESTION, TOOLS))
    _train_answers(folder, [(prompt, TOOL_CALL_TEXT)], steps)


def scaled_tiny_model(folder: Path, factor: float) -> Path:
    """The tiny model with its weight matrices scaled by `factor`.

    As initialised, its next-token distribution is almost flat; scaled, it has clear favourites
    (x10: greedy steps pick different tokens with a clear margin; x20: top tokens at about 0.2,
    0.07, 0.04), which tests of decoding and of learning need.
    """
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(factor)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir()).save_pretrained(folder)
    return folder


def answering_model(examples: list[tuple[list[int], str]], steps: int = 400) -> Path:
    """The tiny model, trained to answer each prompt (token ids, as a span recorded them) with
    its text, greedily; built once per set of examples into the cache, keyed by their hash.

    For clients whose prompts the test cannot write by hand (an agent framework's own
    instructions and tool schemas): run the client once, take the prompt from its span, train.
    """
    key = hashlib.sha256(orjson.dumps(examples)).hexdigest()[:16]
    target_dir = cache_dir() / "models" / f"tiny-answerer-v2-{key}"
    with _building(target_dir) as scratch:
        if scratch is not None:
            _train_answers(scratch, examples, steps)
    return target_dir


def _train_answers(folder: Path, examples: list[tuple[list[int], str]], steps: int) -> None:
    """Teach the model each example until greedy decoding gives every target token by a clear
    margin, then check with `generate` and save; RuntimeError if `steps` were not enough.

    Deterministic: one seed, one order, the CPU. Why this recipe (BENCHMARKS.md, issue 43): the
    old one (AdamW at 1e-2, no clipping, stopped on a loss threshold) failed on 6 of 12 example
    sets, as on CI's machine, whose sampled transcripts differed from ours; stopping on a loss
    let a wrong greedy token through. Clipped steps at 3e-3 learn every set tried, and only the
    target positions go through the 49,152-token head, so a step is cheap.
    """
    shutil.copytree(tiny_model_dir(), folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pairs = [(p, [*encode(tokenizer, text), tokenizer.eos_token_id]) for p, text in examples]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses: list[float] = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses, learned = [], True
        for prompt, target in pairs:
            # The logits that predict the target: the last len(target) + 1 positions, less the
            # one after the target's end.
            logits = model(
                input_ids=torch.tensor([prompt + target]), logits_to_keep=len(target) + 1
            ).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(target))
            loss.backward()
            losses.append(loss.item())
            learned = learned and _greedy_with_margin(logits.detach(), target)
        if learned:
            break
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    with torch.inference_mode():
        for prompt, target in pairs:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=len(target), do_sample=False
            )
            if out[0, len(prompt) :].tolist() != target:
                raise RuntimeError(
                    f"the tiny test model did not learn its answers in {steps} steps "
                    f"(losses {[round(x, 3) for x in losses]})"
                )
    model.save_pretrained(folder)


# How far (in logits) each target token must lead the runner-up before training stops: the
# served model computes in other batch shapes, whose last bits must not flip a greedy choice.
MARGIN = 2.0


def _greedy_with_margin(logits: torch.Tensor, target: list[int]) -> bool:
    top = logits.topk(2, dim=-1)
    right = top.indices[:, 0] == torch.tensor(target)
    return bool(right.all() and (top.values[:, 0] - top.values[:, 1] > MARGIN).all())


def likeliest_replies(model_dir: Path, question: str, k: int = 20) -> list[tuple[float, str]]:
    """The model's `k` likeliest one-token replies to `question` (as the gateway renders it),
    with their probabilities, likeliest first."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = encode(tokenizer, render_chat(tokenizer, [{"role": "user", "content": question}]))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
    top = torch.topk(probs, k)
    texts = [tokenizer.decode([i], skip_special_tokens=True) for i in top.indices.tolist()]
    return list(zip(top.values.tolist(), texts, strict=True))
