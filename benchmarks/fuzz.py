"""Fuzzing the served API: schemathesis over the OpenAPI of the store and the gateway.

A real `lightning-rl serve` (the tiny random Llama, a fresh DuckDB file) runs on loopback as a
child process, and schemathesis' engine runs every operation of its /openapi.json through its
coverage phase (boundary values, wrong types, missing and malformed bodies, unexpected methods
and content types) and its fuzzing phase, with schema-valid and schema-violating data. Random
strings never name the served model, a chat role or an existing rollout, so half of the fuzzed
gateway calls get the served model and real roles (keeping every other generated field), and
half of the calls with a rollout or attempt id in their path get the ids of a real claimed
attempt: the fuzz then reaches tokenizing, generation, span recording and the lifecycle code
instead of stopping at a 404.

Every response is checked for: no 5xx (`not_a_server_error`), 2xx bodies and content types as
the OpenAPI documents them (`response_schema_conformance`, `content_type_conformance`), and a
refusal in the API's own error shape (`api_error_shape`: the store's {"error": {"type",
"message"}}, OpenAI's {"error": {"message", "type", "param", "code"}}, or Anthropic's {"type":
"error", "error": {...}} on /v1/messages). Each request must be answered within
REQUEST_TIMEOUT_S (a request that is not counts as a hang), and the server must still be alive
and healthy at the end. Generation is bounded by the gateway's own limits, set low here
(SERVER_ENV); the long polls (/store/wait, /store/dequeue, up to 30 s by their schema) are
shortened to POLL_CAP_S so that the run spends its time on requests, not on waits.

    python benchmarks/fuzz.py                      # the full run: >= 2000 requests
    python benchmarks/fuzz.py --max-examples 2     # quicker (tests/test_fuzz.py runs this)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results import record  # noqa: E402
from lightning_core.gateway.errors import is_anthropic_path, is_gateway_path  # noqa: E402
from lightning_core.serving.process import free_port, start_serve, stop_serve  # noqa: E402

REQUEST_TIMEOUT_S = 30.0
POLL_CAP_S = 0.2
# Small, so that the largest generation a fuzzed call may ask for (n x max_tokens) stays well
# inside REQUEST_TIMEOUT_S on two CPU cores: 64 tokens of the tiny model take under a second.
SERVER_ENV = {
    "LIGHTNING_DEFAULT_MAX_TOKENS": "8",
    "LIGHTNING_MAX_GENERATION_TOKENS": "64",
    "LIGHTNING_MAX_PROMPT_TOKENS": "1024",
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
ATTEMPTS = 8  # real claimed attempts whose ids the fuzz puts in paths


# ---------------------------------------------------------------------------- the error shape


def error_shape_problem(path: str, status: int, body: bytes) -> str | None:
    """What is wrong with the body of a refusal (status >= 400) on `path`, or None if it is in
    the shape of that path's API."""
    if status < 400:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"{status} body is not JSON: {body[:200]!r}"
    if is_gateway_path(path) and is_anthropic_path(path):
        error = data.get("error") if isinstance(data, dict) else None
        if (
            not isinstance(data, dict)
            or data.get("type") != "error"
            or not _fields(error, ("type", "message"), str)
        ):
            return f'{status} body is not Anthropic\'s {{"type": "error", "error": ...}}: {data}'
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if is_gateway_path(path):
        if not _fields(error, ("message", "type"), str) or not {"param", "code"} <= set(error):
            return f"{status} body is not OpenAI's error (message, type, param, code): {data}"
        return None
    if not _fields(error, ("type", "message"), str):
        return f'{status} body is not the store\'s {{"error": {{type, message}}}}: {data}'
    return None


def _fields(obj: Any, names: tuple[str, ...], kind: type) -> bool:
    return isinstance(obj, dict) and all(isinstance(obj.get(n), kind) for n in names)


# The run the process-wide hooks report to (schemathesis takes before_call and after_call hooks
# only process-wide); None outside run_fuzz.
_active: _Run | None = None


@functools.cache
def _register_with_schemathesis() -> None:
    """The error-shape check and the call hooks, registered once per process."""
    import schemathesis

    @schemathesis.check
    def api_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
        """A refusal is answered in the shape of the API that was called."""
        problem = error_shape_problem(case.operation.path, response.status_code, response.content)
        if problem is not None:
            raise AssertionError(problem)
        return None

    @schemathesis.hook
    def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
        if _active is not None:
            _active.prepare(case)

    @schemathesis.hook
    def after_call(context: Any, case: Any, response: Any) -> None:
        if _active is not None:
            _active.record(case.operation.label, response, case.method)


# ---------------------------------------------------------------------------- the server


@contextlib.contextmanager
def served(workdir: Path) -> Iterator[tuple[str, Any]]:
    """`lightning-rl serve` of the tiny model on a fresh store file: (its URL, its process)."""
    from lightning_core.models import tiny_model_dir

    model = tiny_model_dir()
    port = free_port()
    saved = {k: os.environ.get(k) for k in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    try:
        proc = start_serve(
            workdir / "fuzz.duckdb", port, "--model", str(model), "--tool-format", "hermes"
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_serve(proc)


def _claimed_attempts(url: str, count: int) -> list[dict[str, str]]:
    """Enqueue and claim `count` rollouts: path parameters of real running attempts."""
    import requests

    rollouts = [{"input": {"question": f"fuzz {i}"}} for i in range(count)]
    requests.post(
        f"{url}/store/rollouts", json={"rollouts": rollouts}, timeout=10
    ).raise_for_status()
    ids = []
    for _ in range(count):
        claim = requests.post(f"{url}/store/dequeue", json={"worker_id": "fuzz"}, timeout=10)
        claim.raise_for_status()
        body = claim.json()
        ids.append(
            {
                "rollout_id": body["rollout"]["rollout_id"],
                "attempt_id": body["attempt"]["attempt_id"],
            }
        )
    return ids


# ---------------------------------------------------------------------------- the fuzz


@dataclass
class OperationStats:
    requests: int = 0
    by_class: collections.Counter = field(default_factory=collections.Counter)
    max_latency_s: float = 0.0
    # Refusals by their message's start: shows how deep the fuzz got (--verbose).
    refusals: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class FuzzReport:
    operations: dict[str, OperationStats]
    failures: list[str]  # check failures, one line each
    hangs: list[str]  # requests not answered in time, or not at all
    server_alive: bool
    seconds: float

    @property
    def requests(self) -> int:
        return sum(s.requests for s in self.operations.values())

    @property
    def server_errors(self) -> int:
        return sum(s.by_class[5] for s in self.operations.values())

    def table(self) -> str:
        lines = [f"{'operation':<72} {'requests':>8} {'2xx':>6} {'4xx':>6} {'5xx':>4} {'max s':>6}"]
        for label, s in sorted(self.operations.items(), key=lambda kv: kv[0].split(" ", 1)[::-1]):
            lines.append(
                f"{label:<72} {s.requests:>8} {s.by_class[2]:>6} {s.by_class[4]:>6} "
                f"{s.by_class[5]:>4} {s.max_latency_s:>6.2f}"
            )
        lines.append(
            f"{'total':<72} {self.requests:>8} "
            f"{sum(s.by_class[2] for s in self.operations.values()):>6} "
            f"{sum(s.by_class[4] for s in self.operations.values()):>6} {self.server_errors:>4}"
        )
        return "\n".join(lines)


class _Run:
    """Counts of one run, per operation (the fuzzer's workers call from several threads)."""

    def __init__(self, seed: int, model: str, attempts: list[dict[str, str]]) -> None:
        self.stats: dict[str, OperationStats] = collections.defaultdict(OperationStats)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._model = model
        self._attempts = attempts

    def prepare(self, case: Any) -> None:
        """Just before a case is sent (every phase): real ids and model in half of them."""
        with self._lock:
            _realistic(case, self._rng, self._model, self._attempts)
        _cap_polls(case)

    def record(self, label: str, response: Any, method: str) -> None:
        status = response.status_code
        reason = _refusal_reason(response.content) if status >= 400 else None
        with self._lock:
            s = self.stats[label]
            s.requests += 1
            s.by_class[status // 100] += 1
            s.max_latency_s = max(s.max_latency_s, response.elapsed)
            if reason is not None:
                s.refusals[f"{status} {method.upper()} {reason}"] += 1


def _refusal_reason(body: bytes) -> str:
    try:
        data = orjson.loads(body)
        message = str(data["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "(not an API error)"
    return message[:60]


def _realistic(case: Any, rng: Any, model: str, attempts: list[dict[str, str]]) -> Any:
    """Half of the cases unchanged; the other half with real ids in the path and, on gateway
    calls, the served model and real chat roles (every other generated field kept)."""
    if rng.random() < 0.5:
        return case
    if case.path_parameters and {"rollout_id", "attempt_id"} & set(case.path_parameters):
        ids = rng.choice(attempts)
        for name in ("rollout_id", "attempt_id"):
            if name in case.path_parameters:
                case.path_parameters[name] = ids[name]
    path = case.operation.path
    body = case.body
    if not (is_gateway_path(path) and case.method.upper() == "POST" and isinstance(body, dict)):
        return case
    body["model"] = model
    prompt = body.get("prompt")
    if path.endswith("/v1/completions") and not (isinstance(prompt, str) and prompt):
        body["prompt"] = "Once upon a time"
    messages = body.get("messages")
    if isinstance(messages, list):
        anthropic = is_anthropic_path(path)
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                roles = ("user", "assistant")[i % 2] if anthropic else rng.choice(CHAT_ROLES)
                message["role"] = roles
                if not isinstance(message.get("content"), str | list):
                    message["content"] = "What is 2 + 2?"
    return case


def _cap_polls(case: Any) -> None:
    body = case.body
    if isinstance(body, dict):
        for key in ("wait", "timeout"):
            value = body.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                body[key] = min(value, POLL_CAP_S)


# One client thread: with two, CPython 3.11's AST constructor (hypothesis compiles code while it
# generates) now and then raises a spurious SystemError in the fuzzer itself (CPython gh-106905).
def run_fuzz(url: str, max_examples: int, seed: int = 0, workers: int = 1) -> FuzzReport:
    """Run schemathesis over every operation of the server at `url`."""
    import requests
    import schemathesis
    from schemathesis.engine import events, from_schema

    global _active
    _register_with_schemathesis()
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    attempts = _claimed_attempts(url, ATTEMPTS)
    checks = (
        "not_a_server_error",
        "response_schema_conformance",
        "content_type_conformance",
        "api_error_shape",
    )
    config = schemathesis.Config.from_dict(
        {
            "seed": seed,
            "workers": workers,
            "request-timeout": REQUEST_TIMEOUT_S,
            # Every case of an operation runs, also after one failed: the counts are the run's.
            "continue-on-failure": True,
            "generation": {"mode": "all", "max-examples": max_examples},
            "phases": {"stateful": {"enabled": False}},
            "checks": {"enabled": False, **{name: {"enabled": True} for name in checks}},
        }
    )
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)

    failures: list[str] = []
    hangs: list[str] = []
    start = time.monotonic()
    _active = run = _Run(seed, model, attempts)
    try:
        for event in from_schema(schema).execute():
            if isinstance(event, events.NonFatalError):
                hangs.append(f"{event.label}: {event.value!r}"[:400])
            elif isinstance(event, events.FatalError):
                hangs.append(f"fatal: {event.exception!r}"[:400])
            elif isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
                failures.extend(_failed_checks(event.recorder))
            elif isinstance(event, events.EngineFinished):
                failures.extend(_line(failure) for failure in event.failures)
    finally:
        _active = None
    seconds = time.monotonic() - start
    try:
        alive = requests.get(f"{url}/health", timeout=10).status_code == 200
    except requests.RequestException:
        alive = False
    return FuzzReport(dict(run.stats), failures, hangs, alive, seconds)


def _failed_checks(recorder: Any) -> list[str]:
    from schemathesis.engine import Status

    return [
        _line(node.failure_info.failure)
        for nodes in recorder.checks.values()
        for node in nodes
        if node.status == Status.FAILURE and node.failure_info is not None
    ]


def _line(failure: Any) -> str:
    message = " ".join(failure.message.split())
    return f"{failure.operation}: {failure.title}: {message}"[:400]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--max-examples",
        type=int,
        default=20,
        help="Fuzzed cases per operation and data mode (positive, negative); the coverage "
        "phase adds its own systematic cases.",
    )
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed of the run.")
    parser.add_argument("--workers", type=int, default=1, help="Concurrent fuzzing clients.")
    parser.add_argument(
        "--verbose", action="store_true", help="Also print each operation's commonest refusals."
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir, served(Path(workdir)) as (url, proc):
        report = run_fuzz(url, args.max_examples, args.seed, args.workers)
        alive = report.server_alive and proc.poll() is None
    print(report.table())
    if args.verbose:
        for label, s in sorted(report.operations.items()):
            for reason, count in s.refusals.most_common(4):
                print(f"  {label}: {count} x {reason}")
    for line in report.failures:
        print(f"check failure: {line}")
    for line in report.hangs:
        print(f"hang or transport error: {line}")
    # Fewer examples (the tests' short run) or other settings make figures of their own.
    settings = (args.max_examples, args.seed, args.workers)
    variant = (
        None if settings == (20, 0, 1) else "examples {}, seed {}, workers {}".format(*settings)
    )
    for name, value in (
        ("fuzz_seconds", f"{report.seconds:.0f}"),
        ("fuzz_requests", report.requests),
        ("fuzz_server_errors", report.server_errors),
        ("fuzz_check_failures", len(report.failures)),
        ("fuzz_hangs", len(report.hangs)),
        ("fuzz_server_alive", "yes" if alive else "no"),
    ):
        record(name, value, variant=variant)


if __name__ == "__main__":
    main()
