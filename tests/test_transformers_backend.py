"""TransformersBackend against plain transformers and PEFT on a tiny Llama: the continuous
batching, the KV cache we manage and the mixed-adapter batches must change nothing."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_core.backends.base import Backend, Constraint, GenerationRequest, SamplingParams
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.errors import InvalidInput, NotFound
from tests.models import scaled_tiny_model

# A broken engine shows up as a request that never finishes: fail fast instead.
pytestmark = pytest.mark.timeout(60)

QUESTIONS = ["Hello there", "What is 2 + 2? Explain it at length please.", "Name a colour."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with its weights scaled up.

    As initialised, its logits are so flat that greedy decoding repeats one token forever,
    which cannot tell a right answer from a wrong one; scaled, every step picks a different
    token with a clear margin (top-2 gap above 0.02, far above float error).
    """
    return scaled_tiny_model(tmp_path_factory.mktemp("tiny-varied"), 10)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> Iterator[TransformersBackend]:
    # CPU and float32 even where CUDA is present: the comparisons below are exact.
    served = TransformersBackend(model=str(model_dir), device="cpu")
    yield served
    asyncio.run(served.close())


def _adapter(model_dir: Path, folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    config = LoraConfig(
        r=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapter_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _adapter(model_dir, tmp_path_factory.mktemp("lora-a"), seed=1)


@pytest.fixture(scope="module")
def peft_reference(model_dir: Path, adapter_dir: Path) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.fixture(scope="module")
def prompts(backend: TransformersBackend) -> list[list[int]]:
    templated = [
        backend.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        for question in QUESTIONS
    ]
    return [list(t["input_ids"] if hasattr(t, "keys") else t) for t in templated]


def greedy(
    prompt: list[int], max_new_tokens: int = 24, adapter: str | None = None, **params
) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0, max_new_tokens=max_new_tokens, **params),
        adapter=adapter,
    )


def hf_greedy(model, prompt: list[int], max_new_tokens: int = 24) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
        )
    return output[0, len(prompt) :].tolist()


def full_forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float):
    """Log-softmax of one forward over prompt + completion, at the completion's positions."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    scaled = logits[len(prompt) - 1 : len(prompt) + len(completion) - 1] / temperature
    return torch.log_softmax(scaled, dim=-1)


async def test_satisfies_backend_protocol(backend):
    assert isinstance(backend, Backend)
    assert backend.base_model.startswith("tiny-varied")
    assert backend.dtype == torch.float32


async def test_solo_greedy_equals_hf_generate(backend, reference, prompts):
    for prompt in prompts:
        [choice] = await backend.generate(greedy(prompt))
        assert choice.token_ids == hf_greedy(reference, prompt)
        assert choice.finish_reason == "length"


async def test_request_joining_mid_decode_and_running_one_keep_solo_outputs(
    backend, reference, prompts
):
    first, second = prompts[1], prompts[0]
    finished: list[str] = []
    received: list[int] = []
    stream = backend.stream(greedy(first, max_new_tokens=120))
    async for delta in stream:
        received += delta.token_ids
        if len(received) >= 5:
            break
    # The first is mid-decode: the second must join its batch, not wait for it.
    joining = asyncio.create_task(backend.generate(greedy(second, max_new_tokens=20)))
    joining.add_done_callback(lambda _: finished.append("second"))
    async for delta in stream:
        received += delta.token_ids
    finished.append("first")
    [joined] = await joining
    assert finished == ["second", "first"]
    assert received == hf_greedy(reference, first, 120)
    assert joined.token_ids == hf_greedy(reference, second, 20)


async def test_logprobs_equal_a_full_forward(backend, reference, prompts):
    greedy_request = greedy(prompts[0], top_logprobs=3)
    sampled_request = GenerationRequest(
        prompt_token_ids=prompts[1],
        params=SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_new_tokens=16),
    )
    [greedy_choice], [sampled_choice] = await asyncio.gather(
        backend.generate(greedy_request), backend.generate(sampled_request)
    )
    for request, choice, temperature in (
        (greedy_request, greedy_choice, 1.0),
        (sampled_request, sampled_choice, 0.7),
    ):
        expected = full_forward_logprobs(
            reference, request.prompt_token_ids, choice.token_ids, temperature
        )
        picked = expected.gather(1, torch.tensor(choice.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(choice.logprobs), picked, atol=1e-4, rtol=0)
    assert sampled_choice.top_logprobs is None
    # Every sampled token lies in its top_p = 0.9 nucleus: less than 0.9 of mass ranks above it.
    probs = full_forward_logprobs(reference, prompts[1], sampled_choice.token_ids, 0.7).exp()
    for position, token in enumerate(sampled_choice.token_ids):
        row = probs[position]
        assert row[row > row[token]].sum() < 0.9
    # top_logprobs: 3 alternatives per position, the most likely first (the greedy pick).
    top = greedy_choice.top_logprobs
    assert top is not None and len(top) == len(greedy_choice.token_ids)
    expected = full_forward_logprobs(reference, prompts[0], greedy_choice.token_ids, 1.0)
    values, ids = expected.topk(3, dim=-1)
    for position, alternatives in enumerate(top):
        assert [token for token, _ in alternatives] == ids[position].tolist()
        assert alternatives[0][0] == greedy_choice.token_ids[position]
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in alternatives]), values[position], atol=1e-4, rtol=0
        )


def _stop_inside_a_token(tokenizer, token_ids: list[int]) -> tuple[str, int]:
    """A stop string starting at the second character of token k, and k."""
    for k in range(3, len(token_ids) - 2):
        before = tokenizer.decode(token_ids[:k])
        text = tokenizer.decode(token_ids[: k + 3])
        piece = tokenizer.decode(token_ids[: k + 1])[len(before) :]
        stop = text[len(before) + 1 : len(before) + 4]
        if len(piece) >= 2 and len(stop) == 3 and text.find(stop) == len(before) + 1:
            return stop, k
    raise AssertionError("no token with two or more characters in the completion")


async def test_stop_string_cuts_before_the_token_it_begins_in(backend, prompts):
    [plain] = await backend.generate(greedy(prompts[1], max_new_tokens=40))
    stop, k = _stop_inside_a_token(backend.tokenizer, plain.token_ids)
    [stopped] = await backend.generate(greedy(prompts[1], max_new_tokens=40, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == plain.token_ids[:k]
    assert stopped.logprobs == pytest.approx(plain.logprobs[:k], abs=1e-5)
    assert stop not in backend.tokenizer.decode(stopped.token_ids)
    # Streamed, the tokens held back for a possible stop string never come out.
    deltas = [d async for d in backend.stream(greedy(prompts[1], max_new_tokens=40, stop=[stop]))]
    assert [t for d in deltas for t in d.token_ids] == stopped.token_ids
    assert deltas[-1].finish_reason == "stop"


async def test_stop_token_ends_and_is_included(backend, prompts):
    [plain] = await backend.generate(greedy(prompts[2], max_new_tokens=30))
    token = plain.token_ids[6]
    first = plain.token_ids.index(token)
    [stopped] = await backend.generate(
        greedy(prompts[2], max_new_tokens=30, stop_token_ids=[token])
    )
    assert stopped.token_ids == plain.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


async def test_eos_ends_and_is_included(model_dir, tmp_path):
    """A copy whose eos embedding doubles that of the third greedy token: eos wins by then."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # No special tokens in the prompt: changing eos's (tied) embedding leaves it unchanged.
    prompt = tokenizer("The weather today is", add_special_tokens=False)["input_ids"]
    third = hf_greedy(model, prompt, 3)[2]
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.get_input_embeddings().weight[eos] = 2 * model.get_input_embeddings().weight[third]
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    expected = hf_greedy(model, prompt, 10)
    assert eos in expected
    served = TransformersBackend(model=str(tmp_path), device="cpu")
    try:
        [choice] = await served.generate(greedy(prompt, max_new_tokens=10))
    finally:
        await served.close()
    assert choice.token_ids == expected[: expected.index(eos) + 1]
    assert choice.token_ids[-1] == eos and choice.finish_reason == "stop"


async def test_n_completions_of_one_prompt(backend, prompts):
    request = GenerationRequest(
        prompt_token_ids=prompts[0],
        params=SamplingParams(temperature=1.0, seed=3, max_new_tokens=12),
        n=4,
    )
    choices = await backend.generate(request)
    assert len(choices) == 4
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in choices)
    assert len({tuple(c.token_ids) for c in choices}) > 1
    assert [c.token_ids for c in await backend.generate(request)] == [c.token_ids for c in choices]


async def test_seed_gives_the_same_sample_whatever_else_is_in_the_batch(backend, prompts):
    seeded = GenerationRequest(
        prompt_token_ids=prompts[0],
        params=SamplingParams(temperature=0.9, seed=11, max_new_tokens=20),
    )
    [alone] = await backend.generate(seeded)
    others = [
        GenerationRequest(
            prompt_token_ids=p, params=SamplingParams(temperature=1.0, max_new_tokens=30), n=2
        )
        for p in prompts
    ]
    [batched], *_ = await asyncio.gather(
        backend.generate(seeded), *(backend.generate(o) for o in others)
    )
    assert batched.token_ids == alone.token_ids


async def test_stream_concatenates_to_the_generated_completion(backend, prompts):
    [generated] = await backend.generate(greedy(prompts[1], max_new_tokens=20))
    deltas = [d async for d in backend.stream(greedy(prompts[1], max_new_tokens=20))]
    assert len(deltas) > 1
    assert [t for d in deltas for t in d.token_ids] == generated.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == pytest.approx(generated.logprobs)
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


async def test_clear_errors(backend, prompts):
    with pytest.raises(InvalidInput, match="n must be 1"):
        backend.stream(GenerationRequest(prompt_token_ids=prompts[0], n=2))
    with pytest.raises(InvalidInput, match="2000 tokens \\+ max_new_tokens 100 = 2100"):
        await backend.generate(greedy([5] * 2000, max_new_tokens=100))
    with pytest.raises(NotFound, match="no LoRA adapter named 'missing'"):
        await backend.generate(greedy(prompts[0], adapter="missing"))
    with pytest.raises(NotFound):
        await backend.unload_adapter("missing")


async def test_failed_adapter_load_leaves_the_model_as_it_was(
    backend, reference, adapter_dir, tmp_path, prompts
):
    with pytest.raises(InvalidInput, match="not a PEFT adapter folder"):
        await backend.load_adapter("broken", str(tmp_path))
    # A config with broken weights: PEFT injects the layers, then fails to load them.
    shutil.copy(adapter_dir / "adapter_config.json", tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InvalidInput, match="cannot load LoRA adapter 'broken'"):
        await backend.load_adapter("broken", str(tmp_path))
    assert backend.adapters() == []
    [choice] = await backend.generate(greedy(prompts[0]))
    assert choice.token_ids == hf_greedy(reference, prompts[0])


async def test_lora_adapter_matches_peft(backend, reference, peft_reference, adapter_dir, prompts):
    await backend.load_adapter("policy", str(adapter_dir))
    try:
        assert backend.adapters() == ["policy"]
        prompt = prompts[0]
        [base] = await backend.generate(greedy(prompt))
        [tuned] = await backend.generate(greedy(prompt, adapter="policy"))
        assert base.token_ids == hf_greedy(reference, prompt)
        assert tuned.token_ids != base.token_ids
        assert tuned.token_ids == hf_greedy(peft_reference, prompt)
        expected = full_forward_logprobs(peft_reference, prompt, tuned.token_ids, 1.0)
        picked = expected.gather(1, torch.tensor(tuned.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(tuned.logprobs), picked, atol=1e-4, rtol=0)
        # Base and adapter rows in one batch: each as if alone.
        requests = [greedy(p) for p in prompts] + [greedy(p, adapter="policy") for p in prompts]
        mixed = await asyncio.gather(*(backend.generate(r) for r in requests))
        expected_ids = [hf_greedy(reference, p) for p in prompts]
        expected_ids += [hf_greedy(peft_reference, p) for p in prompts]
        assert [m[0].token_ids for m in mixed] == expected_ids
    finally:
        await backend.unload_adapter("policy")
    assert backend.adapters() == []
    with pytest.raises(NotFound):
        await backend.generate(greedy(prompts[0], adapter="policy"))


async def test_adapters_load_and_replace_while_requests_run(
    backend, reference, model_dir, adapter_dir, tmp_path, prompts
):
    other = _adapter(model_dir, tmp_path / "lora-b", seed=2)
    expected_other = hf_greedy(
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), other).eval(),
        prompts[2],
    )
    running = backend.stream(greedy(prompts[1], max_new_tokens=100))
    received = [t for t in (await anext(running)).token_ids]
    await backend.load_adapter("policy", str(adapter_dir))
    [first] = await backend.generate(greedy(prompts[2], adapter="policy"))
    await backend.load_adapter("policy", str(other))  # replaces it under the same name
    [replaced] = await backend.generate(greedy(prompts[2], adapter="policy"))
    async for delta in running:
        received += delta.token_ids
    await backend.unload_adapter("policy")
    assert received == hf_greedy(reference, prompts[1], 100)
    assert replaced.token_ids == expected_other != first.token_ids
    assert backend.adapters() == []


async def test_abandoned_requests_leave_the_batch(backend, reference, prompts):
    stream = backend.stream(greedy(prompts[0], max_new_tokens=1000))
    await anext(stream)
    await stream.aclose()
    abandoned = asyncio.create_task(backend.generate(greedy(prompts[1], max_new_tokens=1000)))
    await asyncio.sleep(0.05)
    abandoned.cancel()
    [choice] = await backend.generate(greedy(prompts[2]))
    assert choice.token_ids == hf_greedy(reference, prompts[2])
    with pytest.raises(asyncio.CancelledError):
        await abandoned

    def busy() -> tuple[int, int]:
        stats = backend.stats()
        return stats["running"], stats["waiting"]

    for _ in range(100):
        if busy() == (0, 0):
            break
        await asyncio.sleep(0.01)
    assert busy() == (0, 0)


async def test_requests_beyond_max_batch_size_wait_for_a_row(model_dir, reference, prompts):
    served = TransformersBackend(model=str(model_dir), device="cpu", max_batch_size=2)
    try:
        requests = [greedy(p, max_new_tokens=10 + 3 * i) for i, p in enumerate(prompts * 2)]
        results = await asyncio.gather(*(served.generate(r) for r in requests))
    finally:
        await served.close()
    for request, [choice] in zip(requests, results, strict=True):
        expected = hf_greedy(reference, request.prompt_token_ids, request.params.max_new_tokens)
        assert choice.token_ids == expected
    with pytest.raises(RuntimeError, match="closed"):
        await served.generate(requests[0])


async def test_churn_of_requests_joining_and_leaving(backend, reference, prompts):
    """Rows leave mid-batch, others join at every length (a long prompt forces a re-align)."""
    long_prompt = prompts[1] + prompts[0] * 3
    cases = [(prompts[i % 3], 5 + 7 * (i % 5)) for i in range(9)] + [(long_prompt, 12)]

    async def run(delay: float, prompt: list[int], max_new_tokens: int) -> list[int]:
        await asyncio.sleep(delay)
        [choice] = await backend.generate(greedy(prompt, max_new_tokens=max_new_tokens))
        return choice.token_ids

    results = await asyncio.gather(
        *(run(0.01 * i, prompt, max_new) for i, (prompt, max_new) in enumerate(cases))
    )
    for (prompt, max_new), token_ids in zip(cases, results, strict=True):
        assert token_ids == hf_greedy(reference, prompt, max_new)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda(model_dir, reference, prompts):
    exact = TransformersBackend(model=str(model_dir), device="cuda", dtype="float32")
    fast = TransformersBackend(model=str(model_dir), device="cuda")
    try:
        assert fast.dtype == torch.bfloat16
        [choice] = await exact.generate(greedy(prompts[0]))
        assert choice.token_ids == hf_greedy(reference, prompts[0])
        sampled = GenerationRequest(
            prompt_token_ids=prompts[1], params=SamplingParams(seed=1, max_new_tokens=16), n=2
        )
        choices = await fast.generate(sampled)
        assert [len(c.token_ids) for c in choices] == [16, 16]
    finally:
        await exact.close()
        await fast.close()


async def test_shared_prefixes_are_prefilled_once_and_change_nothing(
    backend, reference, peft_reference, adapter_dir, prompts
):
    """Prompts that share a long prefix (an agent's system prompt) in one batch, later ones
    reusing the cached prefix, different suffix lengths, base and adapter: greedy outputs and
    logprobs as without any cache."""
    prefix = prompts[1][:-1] * 2  # a long shared head, then different tails
    tails = [prompts[0][:3], prompts[2], prompts[1][-2:], prompts[0]]
    family = [prefix + tail for tail in tails]
    before = backend.stats()["prefix_tokens_reused"]
    together = await asyncio.gather(*(backend.generate(greedy(p, 12)) for p in family))
    assert backend.stats()["prefix_tokens_reused"] > before
    later = [await backend.generate(greedy(p, 12)) for p in family]
    for prompt, [joint], [alone] in zip(family, together, later, strict=True):
        expected = hf_greedy(reference, prompt, 12)
        assert joint.token_ids == expected
        assert alone.token_ids == expected
        full = full_forward_logprobs(reference, prompt, expected, 1.0)
        picked = full.gather(1, torch.tensor(expected)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(joint.logprobs), picked, atol=1e-4)

    await backend.load_adapter("prefix-lora", str(adapter_dir))
    try:
        outs = await asyncio.gather(
            *(backend.generate(greedy(p, 12, adapter="prefix-lora")) for p in family)
        )
        for prompt, [choice] in zip(family, outs, strict=True):
            assert choice.token_ids == hf_greedy(peft_reference, prompt, 12)
    finally:
        await backend.unload_adapter("prefix-lora")


# Every field bounded, so a random walk through the grammar ends within a few dozen tokens.
SIZE_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


def masked_logprobs(model, compiler, constraint, prompt: list[int], completion: list[int]):
    """full_forward_logprobs at temperature 1 with each position's grammar mask recomputed by a
    fresh matcher: the distribution a constrained completion was sampled from."""
    from lightning_core.backends.grammar import allowed_tokens

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) + len(completion) - 1]
    matcher = compiler.matcher(constraint)
    rows = []
    for position, token in enumerate(completion):
        allowed = allowed_tokens([matcher], logits.shape[-1], logits.device)[0]
        rows.append(torch.log_softmax(logits[position].masked_fill(~allowed, -torch.inf), -1))
        matcher.accept(token)
    return torch.stack(rows)


async def test_constrained_sampling_writes_json_with_the_masked_logprobs(
    backend, reference, prompts
):
    pytest.importorskip("llguidance")
    from lightning_core.backends.grammar import GrammarCompiler

    any_object = Constraint(kind="json_object")
    sizes = Constraint(kind="json_schema", json_schema=SIZE_SCHEMA)

    def constrained(prompt, constraint, n, temperature=1.0, seed=None, max_new_tokens=40):
        params = SamplingParams(
            temperature=temperature, seed=seed, max_new_tokens=max_new_tokens, constraint=constraint
        )
        return GenerationRequest(prompt_token_ids=prompt, params=params, n=n)

    # On a random model an object's strings run on; some of 16 walks close it within 40 tokens.
    requests = [
        constrained(prompts[0], any_object, n=16, seed=3),
        constrained(prompts[1], sizes, n=4, seed=1, max_new_tokens=80),
        constrained(prompts[2], sizes, n=1, temperature=0, max_new_tokens=80),
    ]
    free = greedy(prompts[2], top_logprobs=2)
    *results, [plain] = await asyncio.gather(
        *(backend.generate(r) for r in requests), backend.generate(free)
    )

    # The unconstrained row in the same batches is as if alone.
    assert plain.token_ids == hf_greedy(reference, prompts[2])
    expected = full_forward_logprobs(reference, prompts[2], plain.token_ids, 1.0)
    picked = expected.gather(1, torch.tensor(plain.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(plain.logprobs), picked, atol=1e-4, rtol=0)

    compiler = GrammarCompiler(backend.tokenizer, reference.get_input_embeddings().num_embeddings)
    objects = []
    for request, choices in zip(requests, results, strict=True):
        constraint = request.params.constraint
        for choice in choices:
            expected = masked_logprobs(
                reference, compiler, constraint, request.prompt_token_ids, choice.token_ids
            )
            picked = expected.gather(1, torch.tensor(choice.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(choice.logprobs), picked, atol=1e-4, rtol=0)
            if choice.finish_reason == "stop":
                assert choice.token_ids[-1] == backend.tokenizer.eos_token_id
                text = backend.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
                objects.append((constraint.kind, json.loads(text)))
            else:
                assert constraint is any_object and len(choice.token_ids) == 40
    assert sum(kind == "json_object" for kind, _ in objects) >= 1
    assert sum(kind == "json_schema" for kind, _ in objects) == 5
    for kind, value in objects:
        assert isinstance(value, dict)
        if kind == "json_schema":
            assert set(value) == {"ok", "size"}
            assert isinstance(value["ok"], bool) and value["size"] in ("S", "M", "L")


async def test_a_bad_schema_fails_the_request_before_it_runs(backend, prompts):
    pytest.importorskip("llguidance")
    for schema in (None, {"type": "object", "properties": {"a": {"type": "no-such-type"}}}):
        params = SamplingParams(constraint=Constraint(kind="json_schema", json_schema=schema))
        request = GenerationRequest(prompt_token_ids=prompts[0], params=params)
        with pytest.raises(InvalidInput, match="schema"):
            await backend.generate(request)
        with pytest.raises(InvalidInput, match="schema"):
            [delta async for delta in backend.stream(request)]  # compiled off the loop
    assert backend.stats()["waiting"] == 0


async def test_prompts_of_several_roles_at_once_each_reuse_their_own_prefix(
    backend, reference, prompts
):
    """A multi-agent system sends prompts of two roles together (interleaved: a writer's, a
    checker's, ...). Admission groups them by shared prefix, so each role's prompts reuse its
    own prefix instead of the batch sharing none; outputs are as without any cache."""
    writer = prompts[1][:-1] * 3
    checker = prompts[2] * 3
    tails = [prompts[0][:2], prompts[0][:3], prompts[1][-2:], prompts[2][:2]]
    family = [head + tail for tail in tails for head in (writer, checker)]
    before = backend.stats()["prefix_tokens_reused"]
    outputs = await asyncio.gather(*(backend.generate(greedy(p, 6)) for p in family))
    reused = backend.stats()["prefix_tokens_reused"] - before
    # All but at most the first prompt of each role (arriving alone) reuse their role's head.
    assert reused >= (len(tails) - 1) * (len(writer) + len(checker))
    for prompt, [choice] in zip(family, outputs, strict=True):
        assert choice.token_ids == hf_greedy(reference, prompt, 6)
