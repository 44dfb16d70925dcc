"""A process of its own for the registry tests, as another flow (or machine) sharing the registry
would be: `python -m tests.registry_child '<json>'` registers a version, or holds the promotion
lock until it is killed. It prints one JSON line: the decision, or the ticket held."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def register(args: dict[str, Any]) -> None:
    """Register an adapter; with `barrier`, every one of `peers` processes has reached the
    promotion lock before any takes it, so that without the lock their decisions would meet."""
    from lightning_rl.registry import versions
    from lightning_rl.registry.config import RegistryConfig

    lock = versions.registry_lock

    def lock_after_the_others(client: Any, config: RegistryConfig) -> Any:
        barrier = Path(args["barrier"])
        (barrier / str(os.getpid())).touch()
        deadline = time.monotonic() + 120
        while len(list(barrier.iterdir())) < args["peers"] and time.monotonic() < deadline:
            time.sleep(0.005)
        return lock(client, config)

    versions.registry_lock = lock_after_the_others
    decision = versions.register_policy_version(
        RegistryConfig(**args["config"]),
        args["adapter"],
        base_model="tiny",
        policy_version=args["policy_version"],
        iteration=1,
        score=args["score"],
        benchmark_id=args["benchmark_id"],
        benchmark_size=50,
    )
    print(decision.model_dump_json(), flush=True)


def hold(args: dict[str, Any]) -> None:
    """Take the promotion lock with a short lease and keep it, until killed: a crashed holder."""
    from mlflow import MlflowClient

    from lightning_rl.registry.lock import promotion_lock

    client = MlflowClient(args["uri"], registry_uri=args["uri"])
    with promotion_lock(client, args["name"], ttl_s=args["ttl_s"], wait_s=60) as ticket:
        print(json.dumps({"ticket": ticket.version, "owner": ticket.owner}), flush=True)
        time.sleep(600)


if __name__ == "__main__":
    arguments = json.loads(sys.argv[1])
    {"register": register, "hold": hold}[arguments.pop("do")](arguments)
