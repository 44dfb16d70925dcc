"""Prefect task that checks, after a publish, that the server answers with the new weights.

A LoRA sync can stop silently: the server registers the new version's name but keeps serving
the previous weights, and every metric still looks plausible. So after each publish that
changed an adapter, a fixed probe prompt is completed greedily under the new version and the
previous one; the same tokens with the same logprobs mean the new weights are not being served,
and the run stops (PolicyNotServed) before it samples a rollout from the wrong policy.
"""

from __future__ import annotations

import asyncio
import math

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from lightning_core.data.provenance import ProbeAnswer, ProvenanceConfig, probe_difference
from lightning_core.errors import PolicyNotServed
from lightning_core.security.keys import bearer_header
from lightning_core.semconv import ADAPTER_HASH_METADATA
from lightning_core.types import PolicyVersion
from lightning_rl.policy_server import read_key, store_client

# A greedy completion of a few tokens: seconds on CPU even behind a busy batch.
PROBE_TIMEOUT_S = 300.0


def probe(server_url: str, key: str | None, model: str, config: ProvenanceConfig) -> ProbeAnswer:
    """The probe prompt's greedy completion under `model`, with each token's logprob."""
    reply = httpx.post(
        f"{server_url}/v1/completions",
        headers=bearer_header(key),
        json={
            "model": model,
            "prompt": config.probe_prompt,
            "max_tokens": config.probe_tokens,
            "temperature": 0.0,
            "logprobs": 0,
        },
        timeout=PROBE_TIMEOUT_S,
    )
    if reply.status_code != 200:
        # The server's own words (a version it cannot serve, a folder rewritten since it was
        # published): the run stops with them rather than with a bare status.
        raise PolicyNotServed(
            f"the probe of policy version {model!r} was refused ({reply.status_code}): "
            f"{reply.text[:2000]}"
        )
    logprobs = reply.json()["choices"][0]["logprobs"]
    return ProbeAnswer(tokens=logprobs["tokens"], logprobs=logprobs["token_logprobs"])


def _pairs(versions: dict[str, PolicyVersion], new: str, old: str) -> list[tuple[str, str]]:
    """(new version, the one it replaces) for each adapter the publish may have changed: the
    version itself, or with one policy per agent each agent's own version, paired with the
    previous version's for that agent (the old name itself when it had none: base or shared)."""
    published = versions[new]
    if not published.agent_policies:
        return [(new, old)]
    before = versions.get(old)
    previous = before.agent_policies if before is not None else {}
    return [(own, previous.get(agent, old)) for agent, own in published.agent_policies.items()]


def _same_adapter(versions: dict[str, PolicyVersion], a: str, b: str) -> bool:
    """Whether both versions declared the same adapter hash: then the same answers are right."""
    declared = [
        versions[v].metadata.get(ADAPTER_HASH_METADATA) if v in versions else None for v in (a, b)
    ]
    return declared[0] is not None and declared[0] == declared[1]


@task(
    name="probe-served-policy",
    retries=1,
    retry_delay_seconds=5,
    timeout_seconds=2 * PROBE_TIMEOUT_S,
    cache_policy=NO_CACHE,
)
def probe_served_policy(
    server_url: str,
    policy: str,
    previous: str,
    config: ProvenanceConfig,
    key_file: str | None = None,
) -> dict[str, float]:
    """Check that `policy`, just published, answers the probe otherwise than `previous` does;
    PolicyNotServed when it answers the same. Returns how many adapters were probed
    (`provenance/probes`) and, of those whose greedy tokens stayed the same, the smallest
    logprob difference (`provenance/probe_logprob_delta`)."""

    async def registered() -> dict[str, PolicyVersion]:
        async with store_client(server_url, key_file) as store:
            return {v.name: v for v in await store.list_policy_versions()}

    versions = asyncio.run(registered())
    key = read_key(key_file)
    deltas = []
    for new, old in _pairs(versions, policy, previous):
        if _same_adapter(versions, new, old):
            continue
        delta = probe_difference(
            probe(server_url, key, new, config), probe(server_url, key, old, config)
        )
        if delta <= config.probe_tolerance:
            raise PolicyNotServed(
                f"policy version {new!r} answers the probe exactly as {old!r} does (largest "
                f"logprob difference {delta:.2g}, tolerance {config.probe_tolerance:.2g}), "
                "although its adapter changed: the server is not serving the new weights (an "
                "adapter load that was skipped or failed). The run stops here rather than "
                "train on another policy's tokens; see the server's log, then resume the run."
            )
        deltas.append(delta)
    metrics = {"provenance/probes": float(len(deltas))}
    finite = [d for d in deltas if math.isfinite(d)]
    return metrics | ({"provenance/probe_logprob_delta": min(finite)} if finite else {})
