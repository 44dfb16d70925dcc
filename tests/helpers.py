"""Builders for test data."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from typing import Any

import httpx

from lightning_core import semconv
from lightning_core.types import Claim, Span

_ids = itertools.count(1)


def span(claim: Claim, name: str = "step", **attributes: Any) -> Span:
    n = next(_ids)
    return Span(
        rollout_id=claim.rollout.rollout_id,
        attempt_id=claim.attempt.attempt_id,
        trace_id=f"{n:032x}",
        span_id=f"{n:016x}",
        name=name,
        start_time=time.time(),
        end_time=time.time(),
        attributes=attributes,
    )


def reward_span(claim: Claim, value: float, primary: bool = True) -> Span:
    return span(
        claim,
        semconv.REWARD_SPAN,
        **{semconv.REWARD_VALUE: value, semconv.REWARD_PRIMARY: primary},
    )


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout: float = 120, what: str = "server"
) -> None:
    """Wait until `url`/health answers 200 from the server process `proc`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{what} did not become healthy in {timeout:g} s")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`lightning-rl ARGS` in a child, with no LIGHTNING_* settings leaking in from the
    environment running the tests (plus `env`)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_")}
    clean["COLUMNS"] = "200"  # rich cuts long option names in help at 80 columns
    return subprocess.run(
        [sys.executable, "-m", "lightning_rl.flows.cli", *args],
        capture_output=True,
        text=True,
        # Generous: `train` imports torch, Prefect and MLflow, slow on a busy 2-core machine.
        timeout=180,
        env={**clean, **(env or {})},
    )


def train_params(*layers: dict[str, Any]) -> dict[str, Any]:
    """The train flow's parameters from layers of settings, each over the ones before it
    (nested objects merged key by key). A layer may name a section's setting by its flat name
    (`group_size`), as `lightning-rl train`'s flags do."""
    from lightning_rl.flows.cli.options import merged_layers
    from lightning_rl.flows.config import grouped_fields

    return merged_layers([grouped_fields(layer)[0] for layer in layers])
