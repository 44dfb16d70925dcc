"""The production loop's pure parts: the live gate's sequential test, the rollback rule, the
canary's sticky split, and the reload webhook's checks (against MLflow's own signer)."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid

import httpx
import pytest
from mlflow.webhooks.delivery import _generate_hmac_signature

from lightning_core.errors import InvalidInput
from lightning_core.gateway.routing import Routing, in_canary
from lightning_core.stats.sequential import (
    LiveGateConfig,
    RollbackConfig,
    live_gate,
    mixture_ratio,
    rollback_reason,
)
from lightning_rl.registry.webhook import (
    MLFLOW_PATH,
    RELOAD_PATH,
    ReloadHook,
    check_mlflow_delivery,
    mlflow_signature,
)

GATE = LiveGateConfig(alpha=0.05, tau=0.1, min_episodes=20, max_episodes=400)


def _stats(values: list[float]) -> tuple[int, float, float]:
    n = len(values)
    mean = sum(values) / n
    return n, mean, sum((v - mean) ** 2 for v in values) / max(n - 1, 1)


# ---------------------------------------------------------------------------- the live gate


def test_the_gate_waits_for_the_minimum_sample_whatever_the_difference():
    decision = live_gate(_stats([0.0] * 19), _stats([1.0] * 50), GATE)
    assert decision.verdict == "wait" and "20 episodes" in decision.reason


def test_a_clearly_better_challenger_is_promoted_and_a_worse_one_ended():
    rng = random.Random(0)
    champion = [float(rng.random() < 0.5) for _ in range(60)]
    better = [float(rng.random() < 0.9) for _ in range(60)]
    worse = [float(rng.random() < 0.1) for _ in range(60)]
    promoted = live_gate(_stats(champion), _stats(better), GATE)
    assert promoted.verdict == "promote" and promoted.difference > 0
    assert promoted.statistic >= 1 / GATE.alpha
    ended = live_gate(_stats(champion), _stats(worse), GATE)
    assert ended.verdict == "end" and ended.difference < 0


def test_constant_feedback_has_a_finite_statistic():
    # All 1.0 against all 0.0: a variance of 0 on both sides, floored.
    decision = live_gate(_stats([0.0] * 20), _stats([1.0] * 20), GATE)
    assert decision.verdict == "promote"
    assert mixture_ratio(0.0, 1e-4, 0.1) < 1  # no difference: evidence against a difference


def test_no_difference_after_the_most_episodes_ends_the_canary():
    same = [0.0, 1.0] * 200
    decision = live_gate(_stats(same), _stats(same), GATE)
    assert decision.verdict == "end" and "no difference" in decision.reason


def _null_error_rate(
    gate: LiveGateConfig, rate: float, *, runs: int, looks: int, batch: int, seed: int
) -> float:
    """Share of `runs` canaries, both arms Bernoulli(`rate`), in which the gate decides (any
    decision is an error) when it looks after every `batch` episodes a side, `looks` times."""
    gate = gate.model_copy(update={"max_episodes": 10**6})
    rng = random.Random(seed)
    errors = 0
    for _ in range(runs):
        a: list[float] = []
        b: list[float] = []
        for _look in range(looks):
            a += [float(rng.random() < rate) for _ in range(batch)]
            b += [float(rng.random() < rate) for _ in range(batch)]
            if live_gate(_stats(a), _stats(b), gate).verdict != "wait":
                errors += 1
                break
    return errors / runs


def test_peeking_after_every_batch_keeps_the_error_rate_near_alpha():
    # Both arms Bernoulli(0.5). A fixed-sample z-test read after each batch would err far more
    # often than alpha; the mixture test stays under it (Ville).
    rate = _null_error_rate(GATE, 0.5, runs=300, looks=40, batch=10, seed=1)
    assert rate <= GATE.alpha + 0.02, rate


@pytest.mark.parametrize("success", [0.15, 0.4])
def test_the_drift_demos_gate_keeps_its_error_rate_on_rare_successes_looked_at_each_episode(
    success,
):
    # The drift demo's gate (tau 0.3, 15 episodes a side) on 0/1 feedback, looked at after every
    # episode: with rare successes the plug-in variances are small early on (2 of 15 right is
    # 0.12 a side), which is where an early, wrong decision would come from.
    gate = LiveGateConfig(alpha=0.05, tau=0.3, min_episodes=15)
    rate = _null_error_rate(gate, success, runs=400, looks=150, batch=1, seed=2)
    assert rate <= gate.alpha + 0.02, rate


# ---------------------------------------------------------------------------- rollback rule


def test_rollback_needs_the_margin_and_the_sample():
    rules = RollbackConfig(margin=0.1, min_episodes=20)
    assert rollback_reason((30, 0.5), (30, 0.7), rules) is not None
    assert rollback_reason((30, 0.65), (30, 0.7), rules) is None  # within the margin
    assert rollback_reason((10, 0.0), (30, 0.7), rules) is None  # too few episodes yet
    off = rules.model_copy(update={"enabled": False})
    assert rollback_reason((30, 0.0), (30, 0.9), off) is None


# ---------------------------------------------------------------------------- the canary split


def test_the_split_is_sticky_and_near_the_fraction():
    episodes = [f"order-{i}" for i in range(4000)]
    arms = [in_canary(e, "m-v2", 0.25) for e in episodes]
    assert arms == [in_canary(e, "m-v2", 0.25) for e in episodes]  # the same every time
    assert 0.22 < sum(arms) / len(arms) < 0.28
    # Each challenger draws its own slice; none at 0, all at 1.
    other = [in_canary(e, "m-v3", 0.25) for e in episodes]
    assert other != arms
    assert not any(in_canary(e, "m-v2", 0.0) for e in episodes[:100])
    assert all(in_canary(e, "m-v2", 1.0) for e in episodes[:100])


def test_routing_resolves_champion_challenger_and_leaves_other_names():
    routing = Routing(champion="m-v1", challenger="m-v2", canary_fraction=0.5)
    served = {routing.resolve("champion", f"e{i}") for i in range(50)}
    assert served == {"m-v1", "m-v2"}
    assert routing.resolve("champion", None) == "m-v1"  # no episode: no feedback, champion
    assert routing.resolve("challenger", None) == "m-v2"
    assert routing.resolve("m-v1", "e1") is None  # a version's own name: the gateway's lookup
    assert Routing().resolve("champion", "e1") is None  # unset: the gateway's aliases apply
    with pytest.raises(InvalidInput):
        Routing(champion="m-v1", canary_fraction=0.1)


# ---------------------------------------------------------------------------- reload webhook


def test_our_signature_check_accepts_mlflows_own_signature():
    body = json.dumps({"entity": "model_version_alias", "data": {"name": "m"}})
    now = str(int(time.time()))
    headers = {
        "X-MLflow-Signature": _generate_hmac_signature("s3cret", "d-1", now, body),
        "X-MLflow-Timestamp": now,
        "X-MLflow-Delivery-Id": "d-1",
    }
    assert mlflow_signature("s3cret", "d-1", now, body.encode()) == headers["X-MLflow-Signature"]
    assert check_mlflow_delivery("s3cret", headers, body.encode()) is None
    assert check_mlflow_delivery("other", headers, body.encode()) == "bad signature"
    assert "timestamp" in check_mlflow_delivery(
        "s3cret", headers, body.encode(), now=time.time() + 3600
    )
    assert check_mlflow_delivery("s3cret", {}, body.encode()).startswith("unsigned")


def test_the_reload_hook_nudges_only_on_signed_small_deliveries_about_its_model():
    nudged = threading.Semaphore(0)
    hook = ReloadHook("127.0.0.1", 0, "s3cret", "m", nudged.release).start()
    try:

        def mlflow_post(payload: dict, secret: str = "s3cret") -> httpx.Response:
            body = json.dumps(payload).encode()
            now = str(int(time.time()))
            # A new id per delivery, as MLflow sends (one id is taken once: a replay).
            delivery = uuid.uuid4().hex
            return httpx.post(
                hook.url + MLFLOW_PATH,
                content=body,
                headers={
                    "X-MLflow-Signature": mlflow_signature(secret, delivery, now, body),
                    "X-MLflow-Timestamp": now,
                    "X-MLflow-Delivery-Id": delivery,
                },
            )

        ours = {"entity": "model_version_alias", "action": "created", "data": {"name": "m"}}
        assert mlflow_post(ours, secret="wrong").status_code == 401
        other = {**ours, "data": {"name": "another-model"}}
        assert mlflow_post(other).status_code == 200
        assert not nudged.acquire(timeout=0.5)  # another model's alias: no look
        assert mlflow_post(ours).status_code == 200
        assert nudged.acquire(timeout=10)
        big = httpx.post(hook.url + RELOAD_PATH, content=b"x" * (65 * 1024))
        assert big.status_code == 413
        bad = httpx.post(hook.url + RELOAD_PATH, headers={"X-Lightning-Reload-Secret": "no"})
        assert bad.status_code == 401
        good = httpx.post(hook.url + RELOAD_PATH, headers={"X-Lightning-Reload-Secret": "s3cret"})
        assert good.status_code == 200 and nudged.acquire(timeout=10)
    finally:
        hook.close()
