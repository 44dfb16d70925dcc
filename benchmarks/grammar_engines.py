"""Grammar engines for structured outputs, measured on our tokenizers: llguidance, xgrammar and
outlines-core.

    pip install --target /tmp/grammar_libs --no-deps \\
        llguidance xgrammar apache-tvm-ffi outlines-core
    PYTHONPATH=/tmp/grammar_libs .venv/bin/python benchmarks/grammar_engines.py

Only llguidance is a project dependency; the --target folder keeps the other two (and xgrammar's
torch and triton requirements, which --no-deps skips: its CPU path needs neither) out of .venv.
An engine that cannot be imported is skipped with the line that installs it.

Per tokenizer (the default model's, the tiny test model's) and grammar (any JSON object; a pydantic
schema with str, int, enum, list[str] and a nested object):
- compile ms: grammar build plus first mask on a fresh compiler (engines differ in what they do
  ahead of time and what lazily, so time-to-first-mask is the fair figure);
- step µs p50/p95: one decoding step's engine work, the bitmask of every row plus advancing every
  matcher by its sampled token, at batch 1 and 8 (one [8, vocab] bitmask per step); unpacking the
  bitmask into a bool tensor is the same for every engine and left out. "cpu" is the process's
  CPU time over all threads (what other load on a shared machine leaves alone), "wall" latency;
- ended / valid: walks that sampled EOS within 200 tokens / those that parse and validate.
Walks sample allowed tokens from seeded random logits plus a bias towards JSON punctuation, so
they close strings and containers within the budget. Whitespace is bounded in every engine: at
most 4 characters per gap (outlines-core: its default, one optional space).

--quick (the tests run it): the tiny model's tokenizer (SmolLM2's), 8 walks of at most 40 tokens
per batch size, with whichever engines are installed (llguidance, a dependency, always is).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from enum import StrEnum

import torch
from pydantic import BaseModel, ConfigDict
from transformers import AutoConfig, AutoTokenizer

from lightning_core.backends.grammar import unpack_bitmask
from lightning_core.models import resolve_model

INSTALL = {
    "llguidance": "pip install llguidance",
    "xgrammar": "pip install --no-deps xgrammar apache-tvm-ffi",
    "outlines-core": "pip install outlines-core",
}
THREADS = os.cpu_count() or 1
# Weight of JSON punctuation (and EOS) in the walks' logits: e^6 makes a walk close its strings
# and containers within the token budget; at 4 most schema walks were still open at 200 tokens.
BIAS = 6.0


class Role(StrEnum):
    admin = "admin"
    user = "user"
    guest = "guest"


# extra="forbid" puts additionalProperties: false in the schema, so every engine gets the same
# language (xgrammar forbids unknown keys by default, the other two follow the schema).
class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str
    zip_code: str


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    age: int
    role: Role
    tags: list[str]
    address: Address


GRAMMARS = {"json_object": {"type": "object"}, "json_schema": Person.model_json_schema()}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a vocab entry uses for each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return {c: b for b, c in chars.items()}


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes of every token id of a byte-level BPE tokenizer; None for special tokens."""
    decoder, special = _byte_decoder(), set(tokenizer.all_special_ids)
    out: list[bytes | None] = [None] * len(tokenizer)
    for text, i in tokenizer.get_vocab().items():
        if i not in special and all(c in decoder for c in text):
            out[i] = bytes(decoder[c] for c in text)
    return out


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=THREADS)

    def compile(self, schema: dict):
        options = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,4}"}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        # A new LLMatcher builds its parser again (~1 ms); a copy of one takes ~15 µs.
        template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        return template.deep_copy

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)
        else:
            rows = [(m, i) for i, m in enumerate(matchers)]
            self.executor.unsafe_compute_mask_ptr(
                rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
            )

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=THREADS)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=THREADS, cache_enabled=False)
        compiled = compiler.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=4)
        return lambda: self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int):
        import outlines_core

        self.oc = outlines_core
        self.eos = tokenizer.eos_token_id
        self.vocabulary = outlines_core.Vocabulary(self.eos, {})
        for i, piece in enumerate(token_bytes(tokenizer)):
            if piece is not None:
                self.vocabulary.insert(piece, i)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        index = self.oc.Index(regex, self.vocabulary)
        return lambda: self.oc.Guide(index)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        # No batch API: one guide after the other.
        for row, guide in zip(bitmask, matchers, strict=False):
            guide.write_mask_into(row.data_ptr(), row.numel(), 4)

    def accept(self, guide, token: int) -> bool:
        # EOS in a final state ends the walk; advancing past it is not supported.
        if token == self.eos:
            return guide.is_finished()
        guide.advance(token, return_tokens=False)
        return True


def walk_batch(engine, new_matcher, bias, eos, batch, gen, max_tokens, steps):
    """Sample `batch` completions under the grammar: their token ids, and whether each ended."""
    vocab = bias.shape[0]
    matchers = [new_matcher() for _ in range(batch)]
    base = torch.randn(batch, vocab, generator=gen) + bias
    bitmask = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int32)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    ended = [False] * batch
    for _ in range(max_tokens):
        live = [i for i in range(batch) if not ended[i]]
        if not live:
            break
        wall, cpu = time.perf_counter_ns(), time.process_time_ns()
        engine.fill([matchers[i] for i in live], bitmask)
        wall, cpu = time.perf_counter_ns() - wall, time.process_time_ns() - cpu
        mask = unpack_bitmask(bitmask[: len(live)])[:, :vocab]
        logits = base[live].masked_fill(~mask, float("-inf"))
        # Gumbel-max: a draw from softmax(logits), several times faster than multinomial.
        uniform = torch.rand(logits.shape, generator=gen).clamp_min(1e-20)
        picks = (logits - (-uniform.log()).log()).argmax(-1).tolist()
        wall, cpu = wall - time.perf_counter_ns(), cpu - time.process_time_ns()
        for i, token in zip(live, picks, strict=True):
            if not engine.accept(matchers[i], token):
                raise RuntimeError(f"{engine.name} refused token {token} its own mask allowed")
        steps["wall"].append((wall + time.perf_counter_ns()) / 1000)
        steps["cpu"].append((cpu + time.process_time_ns()) / 1000)
        for i, token in zip(live, picks, strict=True):
            tokens[i].append(token)
            ended[i] = token == eos
    return tokens, ended


def is_valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if schema == GRAMMARS["json_object"]:
        return isinstance(value, dict)
    try:
        import jsonschema
    except ImportError:
        try:
            Person.model_validate(value)
        except ValueError:
            return False
        return True
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(engine, tokenizer, grammar: str, walks: int, max_tokens: int, seed: int) -> dict:
    schema = GRAMMARS[grammar]
    vocab = engine.vocab_size
    start = time.perf_counter()
    new_matcher = engine.compile(schema)
    engine.fill([new_matcher()], torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32))
    row = {"compile_ms": (time.perf_counter() - start) * 1000}
    pieces = token_bytes(tokenizer)
    bias = torch.tensor(
        [BIAS if p and not p.strip(b' {}[]",:') else 0.0 for p in pieces]
        + [0.0] * (vocab - len(pieces))
    )
    bias[tokenizer.eos_token_id] = BIAS
    gen = torch.Generator().manual_seed(seed)
    ended = valid = 0
    for batch in (1, 8):
        steps: dict[str, list[float]] = {"wall": [], "cpu": []}
        for _ in range(walks // batch):
            tokens, done = walk_batch(
                engine, new_matcher, bias, tokenizer.eos_token_id, batch, gen, max_tokens, steps
            )
            for ids, finished in zip(tokens, done, strict=True):
                ended += finished
                valid += finished and is_valid(tokenizer.decode(ids[:-1]), schema)
        for clock, values in steps.items():
            row[f"b{batch} {clock}"] = (
                f"{percentile(values, 0.5):.0f} / {percentile(values, 0.95):.0f}"
            )
    row["ended"], row["valid"], row["walks"] = ended, valid, walks + walks // 8 * 8
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["SmolLM2-135M-Instruct", "tiny"])
    parser.add_argument("--walks", type=int, default=16, help="Walks per batch size.")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny tokenizer, 8 short walks")
    args = parser.parse_args(argv)
    if args.quick:
        # 8: the batch-8 rows need at least one batch of 8 walks.
        args.models, args.walks, args.max_tokens = ["tiny"], 8, 40
    # Sampling's OpenMP threads spin after each op and would take the cores from the engines'.
    torch.set_num_threads(1)
    engines = []
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        try:
            __import__(cls.name.replace("-", "_"))
            engines.append(cls)
        except ImportError:
            print(f"skipping {cls.name}: not installed ({INSTALL[cls.name]})")
    print(f"torch threads {torch.get_num_threads()}, engine threads {THREADS}\n")
    columns = ["b1 cpu", "b1 wall", "b8 cpu", "b8 wall"]
    print(
        "| tokenizer | engine | grammar | tokenizer prep ms | compile ms | "
        + " | ".join(f"{c} p50 / p95 µs" for c in columns)
        + " | ended | valid |"
    )
    print("|---" * (7 + len(columns)) + "|")
    for model in args.models:
        folder = resolve_model(None if model == "SmolLM2-135M-Instruct" else model)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        vocab_size = AutoConfig.from_pretrained(folder).vocab_size
        for cls in engines:
            start = time.perf_counter()
            engine = cls(tokenizer, vocab_size)
            prep_ms = (time.perf_counter() - start) * 1000
            engine.vocab_size = vocab_size
            for grammar in GRAMMARS:
                r = measure(engine, tokenizer, grammar, args.walks, args.max_tokens, args.seed)
                cells = [
                    f"{model} ({vocab_size})",
                    cls.name,
                    grammar,
                    f"{prep_ms:.0f}",
                    f"{r['compile_ms']:.1f}",
                    *(r[c] for c in columns),
                    f"{r['ended']}/{r['walks']}",
                    f"{r['valid']}/{r['ended']}",
                ]
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
