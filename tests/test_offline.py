"""Offline training on captured production episodes: rewards from feedback, the batch built from
gateway spans, the behaviour gap that picks the method, and both updates on the tiny model."""

from __future__ import annotations

import itertools
import math

import orjson
import pytest
import torch
from pydantic import ValidationError

from lightning_core import semconv
from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.losses import likelihood_loss
from lightning_core.algo.trainer import ADAPTER_CONFIG, LoRATrainer
from lightning_core.backends.base import Choice, SamplingParams
from lightning_core.data.adapter import AdapterConfig
from lightning_core.data.offline import (
    OfflineBatch,
    OfflineConfig,
    choose_method,
    combine_feedback,
    episode_batch,
    filtered,
)
from lightning_core.errors import InvalidInput
from lightning_core.gateway.spans import LLMCall, llm_call_span
from lightning_core.models import tiny_model_dir
from lightning_core.types import (
    Feedback,
    Rollout,
    RolloutMode,
    RolloutStatus,
    Span,
    Transition,
)

_seq = itertools.count(1)
_clock = itertools.count(1000)


def feedback(episode: str, value: float, source: str = "user", time: float = 0.0) -> Feedback:
    seq = next(_seq)
    return Feedback(
        seq=seq,
        episode_id=episode,
        source=source,
        value=value,
        time=time or float(seq),
        recorded_at=float(seq),
    )


def episode(episode_id: str, policy_version: str = "champion") -> Rollout:
    return Rollout(
        rollout_id=f"ep-{episode_id}",
        input={"episode_id": episode_id},
        mode=RolloutMode.production,
        status=RolloutStatus.running,
        policy_version=policy_version,
        enqueued_at=1.0,
    )


def call(
    episode_id: str,
    prompt: list[int],
    response: list[int],
    logprobs: list[float] | None = None,
    agent: str | None = None,
) -> Span:
    """The span the gateway records for one captured call (its own span builder)."""
    t = float(next(_clock))
    return llm_call_span(
        LLMCall(
            rollout_id=f"ep-{episode_id}",
            attempt_id=f"at-{episode_id}",
            operation="chat",
            api="chat.completions",
            request_model="champion",
            policy_version="champion",
            response_id=f"chatcmpl-{int(t)}",
            params=SamplingParams(temperature=1.0),
            prompt_token_ids=prompt,
            choices=[
                Choice(
                    token_ids=response,
                    logprobs=logprobs if logprobs is not None else [-0.5] * len(response),
                    finish_reason="stop",
                )
            ],
            start_time=t,
            end_time=t + 0.5,
            agent_name=agent,
        )
    )


def reward_span(episode_id: str, value: float) -> Span:
    t = float(next(_clock))
    return Span(
        rollout_id=f"ep-{episode_id}",
        attempt_id=f"at-{episode_id}",
        trace_id="a" * 32,
        span_id=f"{int(t):016x}",
        name=semconv.REWARD_SPAN,
        start_time=t,
        end_time=t,
        attributes={semconv.REWARD_VALUE: value},
    )


# ---------------------------------------------------------------------------- combining feedback


def test_feedback_combines_by_each_rule_with_the_newest_row_per_source():
    rows = [
        feedback("e", -5.0, "user", time=1.0),  # replaced by the next user row: never counts
        feedback("e", 1.0, "user", time=10.0),
        feedback("e", 0.0, "judge", time=20.0),
        feedback("e", 0.5, "tests", time=5.0),
    ]
    assert combine_feedback(rows, "mean") == pytest.approx(0.5)
    assert combine_feedback(rows, "min") == 0.0
    assert combine_feedback(rows, "max") == 1.0
    assert combine_feedback(rows, "sum") == pytest.approx(1.5)
    assert combine_feedback(rows, "latest") == 0.0  # the judge's signal happened last
    # weighted mean over the listed sources; "tests" is unlisted and weighs 0
    assert combine_feedback(rows, "weighted", {"user": 3.0, "judge": 1.0}) == pytest.approx(0.75)
    assert combine_feedback(rows[1:2], "weighted", {"user": 2.0}) == 1.0


def test_latest_breaks_equal_times_by_the_later_recorded_row():
    rows = [feedback("e", 0.2, "a", time=7.0), feedback("e", 0.9, "b", time=7.0)]
    assert combine_feedback(rows, "latest") == 0.9


def test_combining_nothing_is_refused():
    with pytest.raises(InvalidInput, match="without feedback"):
        combine_feedback([], "mean")
    with pytest.raises(InvalidInput, match="has a weight"):
        combine_feedback([feedback("e", 1.0, "user")], "weighted", {"judge": 1.0})
    with pytest.raises(InvalidInput, match="one episode"):
        combine_feedback([feedback("e", 1.0), feedback("f", 1.0)], "mean")
    with pytest.raises(ValidationError):
        OfflineConfig(weights={"user": -1.0})
    with pytest.raises(ValidationError):
        OfflineConfig(combine="median")


# ---------------------------------------------------------------------------- the batch


def production() -> tuple[list[Rollout], list[Span], list[Feedback]]:
    """a: two calls, reward 1 (two sources, mean); b: one call, reward 0; c: rated, no call;
    d: captured, not rated; e: rated, its rollout not passed."""
    rollouts = [episode("a"), episode("b"), episode("c"), episode("d")]
    spans = [
        call("a", [1, 5, 6], [7, 8]),
        reward_span("a", 5.0),  # an agent's own reward span: feedback is the reward offline
        call("a", [1, 5, 6, 7, 8, 9], [10]),
        call("b", [1, 5], [11, 12, 13], agent="helper"),
        call("d", [1, 2], [3]),
    ]
    rows = [
        feedback("a", 1.5, "user"),
        feedback("a", 0.5, "judge"),
        feedback("b", 0.0, "user"),
        feedback("c", 1.0, "user"),
        feedback("e", 1.0, "user"),
    ]
    return rollouts, spans, rows


def test_episode_batch_from_gateway_spans():
    rollouts, spans, rows = production()
    batch = episode_batch(rollouts, spans, rows, OfflineConfig())

    a = [t for t in batch.transitions if t.rollout_id == "ep-a"]
    b = [t for t in batch.transitions if t.rollout_id == "ep-b"]
    assert len(batch.transitions) == 3
    assert [(t.step, t.prompt_token_ids, t.response_token_ids) for t in a] == [
        (0, [1, 5, 6], [7, 8]),
        (1, [1, 5, 6, 7, 8, 9], [10]),
    ]
    assert a[0].response_logprobs == [-0.5, -0.5] and a[0].policy_version == "champion"
    assert b[0].agent_name == "helper" and b[0].attempt_id == "at-b"
    # The reward is the combined feedback, on the last call; the reward span is not added.
    assert [t.reward for t in a] == [0.0, 1.0] and [t.reward for t in b] == [0.0]
    # Equal credit: every call of an episode gets its reward minus the batch's mean (0.5).
    assert [t.advantage for t in a] == [0.5, 0.5] and [t.advantage for t in b] == [-0.5]
    assert batch.mean_reward == 0.5

    assert set(batch.facts) == {"ep-a", "ep-b"}
    assert batch.facts["ep-a"].episode_return == 1.0 and batch.facts["ep-a"].success
    assert not batch.facts["ep-b"].success and batch.facts["ep-b"].policy_version == "champion"
    assert batch.skipped == 1 and batch.skipped_ids == ["c"]
    assert batch.missing_ids == ["e"]
    rows_out = {e["episode_id"]: e for e in batch.episodes}
    assert rows_out["a"] == {
        "episode_id": "a",
        "rollout_id": "ep-a",
        "reward": 1.0,
        "advantage": 0.5,
        "sources": ["judge", "user"],
        "calls": 2,
        "prompt_tokens": 9,
        "response_tokens": 3,
        "tokens": 12,
        "policy_version": "champion",
        "through_seq": rows[1].seq,
    }
    orjson.dumps(batch.episodes)  # JSON-ready: the lead hashes them
    assert batch.metrics()["offline/skipped_episodes"] == 1.0


def test_episode_batch_combines_and_filters_agents():
    rollouts, spans, rows = production()
    batch = episode_batch(
        rollouts, spans, rows, OfflineConfig(combine="max"), AdapterConfig(agents=["helper"])
    )
    # Only b's call is of agent "helper": a has no call left to train and is skipped.
    assert [t.rollout_id for t in batch.transitions] == ["ep-b"]
    assert sorted(batch.skipped_ids) == ["a", "c"] and batch.skipped == 2
    assert batch.transitions[0].advantage == 0.0  # alone in the batch: it is the baseline

    weighted = episode_batch(
        rollouts, spans, rows, OfflineConfig(combine="weighted", weights={"judge": 1.0})
    )
    # Only a has a judge: b and c have no weighted feedback and are left out, not rewarded 0.
    assert [e["episode_id"] for e in weighted.episodes] == ["a"]
    assert weighted.episodes[0]["reward"] == 0.5 and weighted.episodes[0]["sources"] == ["judge"]
    assert sorted(weighted.unrewarded_ids) == ["b", "c"]


def test_episode_batch_refuses_training_rollouts():
    rollout = episode("a").model_copy(update={"mode": RolloutMode.train, "rollout_id": "ro-1"})
    with pytest.raises(InvalidInput, match="not a production episode"):
        episode_batch([rollout], [], [feedback("a", 1.0)], OfflineConfig())


def test_filtered_keeps_the_good_episodes_with_advantage_one():
    rollouts, spans, rows = production()
    batch = episode_batch(rollouts, spans, rows, OfflineConfig())
    above_mean = filtered(batch, OfflineConfig())
    assert [t.rollout_id for t in above_mean] == ["ep-a", "ep-a"]
    assert all(t.advantage == 1.0 for t in above_mean)
    assert [t.advantage for t in batch.transitions] == [0.5, 0.5, -0.5]  # unchanged
    assert len(filtered(batch, OfflineConfig(min_reward=0.0))) == 3
    assert filtered(batch.transitions, OfflineConfig(min_reward=1.0)) == above_mean
    # All rewards equal: nothing is above the mean, nothing is kept.
    same = episode_batch(rollouts, spans, [feedback(e, 0.1) for e in "ab"], OfflineConfig())
    assert filtered(same, OfflineConfig()) == [] and filtered(OfflineBatch(), OfflineConfig()) == []


def test_choose_method():
    auto = OfflineConfig(max_behaviour_kl=0.05)
    assert choose_method({"offline/behaviour_kl": 0.01}, auto) == "importance"
    assert choose_method({"offline/behaviour_kl": 0.2}, auto) == "filtered"
    forced = OfflineConfig(method="importance")
    assert choose_method({"offline/behaviour_kl": 9.0}, forced) == "importance"
    with pytest.raises(InvalidInput, match="behaviour_gap"):
        choose_method({}, auto)


# ---------------------------------------------------------------------------- the updates


def test_likelihood_loss_is_the_mean_negative_logprob_with_its_gradient():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], dtype=torch.float64).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.float64)
    out = likelihood_loss(logprobs, mask)
    assert float(out.loss) == pytest.approx(3.5 / 3) and out.clip_frac == 0.0 and out.kl == 0.0
    out.loss.backward()
    expected = torch.tensor([[-1 / 3, -1 / 3], [-1 / 3, 0.0]], dtype=torch.float64)
    assert torch.allclose(logprobs.grad, expected)
    per_seq = likelihood_loss(logprobs.detach(), mask, "seq-mean-token-mean")
    assert float(per_seq.loss) == pytest.approx((1.5 + 0.5) / 2)
    ref = logprobs.detach() - 0.5  # k3 of a log-ratio of -0.5 on every token
    penalised = likelihood_loss(logprobs.detach(), mask, ref_logprobs=ref, kl_coef=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert penalised.kl == pytest.approx(k3)
    assert float(penalised.loss) == pytest.approx(3.5 / 3 + 0.1 * k3)


TRAIN_KEYS = {
    "train/loss",
    "train/kl",
    "train/clip_frac",
    "train/entropy",
    "train/grad_norm",
    "train/tokens_per_s",
    "train/is_ratio_mean",
    "train/is_ratio_max",
    "train/is_truncated_frac",
    "train/ratio_masked_frac",
    "train/overlong_frac",
    "train/forward_tokens_saved_frac",
    "train/prefix_breaks",
}


def train_keys(metrics: dict[str, float]) -> set[str]:
    # Prefix breaks are also counted per agent, under each agent's name.
    return {k for k in metrics if not k.startswith("train/prefix_breaks/")}


def config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"model": str(tiny_model_dir()), "learning_rate": 1e-2, **overrides})


def calls() -> dict[str, list[tuple[list[int], list[int]]]]:
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    return {
        "good": [(ids(6), ids(4)), (ids(9), ids(3))],
        "bad": [(ids(5), ids(5))],
        "meh": [(ids(7), ids(2))],
    }


def recorded_batch(trainer: LoRATrainer | None, far: bool = False) -> OfflineBatch:
    """Episodes good (reward 1), bad (0) and meh (0.5), captured with the logprobs of
    `trainer`'s current policy, or (far) of a policy far from it."""
    spans, rollouts = [], []
    for name, pairs in calls().items():
        rollouts.append(episode(name))
        for prompt, response in pairs:
            if far:
                logprobs = [-1.0] * len(response)  # the tiny model gives ~ -10.8 per token
            else:
                probe = Transition(
                    rollout_id="probe", step=0, prompt_token_ids=prompt, response_token_ids=response
                )
                [logprobs] = trainer.response_logprobs([probe])
            spans.append(call(name, prompt, response, logprobs))
    rewards = [feedback("good", 1.0), feedback("bad", 0.0), feedback("meh", 0.5)]
    return episode_batch(rollouts, spans, rewards, OfflineConfig())


def by_episode(trainer: LoRATrainer, batch: OfflineBatch) -> dict[str, float]:
    """Summed current logprob of each episode's response tokens."""
    out: dict[str, float] = {}
    current = trainer.response_logprobs(batch.transitions)
    for t, logprobs in zip(batch.transitions, current, strict=True):
        out[t.rollout_id] = out.get(t.rollout_id, 0.0) + sum(logprobs)
    return out


def test_behaviour_gap_is_zero_on_the_policys_own_episodes_and_large_far_from_them():
    trainer = LoRATrainer(config(micro_batch_tokens=16))
    lora = trainer.lora_state()
    own = recorded_batch(trainer)
    assert len(trainer._micro_batches(trainer._rows(own.transitions, merge=False))) > 1
    gap = trainer.behaviour_gap(own.transitions)
    assert gap["offline/behaviour_kl"] == pytest.approx(0.0, abs=1e-6)
    assert gap["offline/outside_clip"] == 0.0 and gap["offline/tokens"] == 14
    assert choose_method(gap, OfflineConfig()) == "importance"

    far = trainer.behaviour_gap(recorded_batch(None, far=True).transitions)
    # log ratio ~ -9.8 per token: k3 = e^-9.8 + 9.8 - 1 ~ 8.8
    assert far["offline/behaviour_kl"] > 5 and far["offline/outside_clip"] == 1.0
    assert choose_method(far, OfflineConfig()) == "filtered"
    # Measuring trains nothing.
    assert trainer.version == 0
    assert all(torch.equal(lora[n], p) for n, p in trainer.lora_state().items())


def test_a_likelihood_step_raises_the_likelihood_of_the_kept_responses():
    trainer = LoRATrainer(config())
    batch = recorded_batch(None, far=True)
    kept = filtered(batch, OfflineConfig())
    assert {t.rollout_id for t in kept} == {"ep-good"}
    before = trainer.response_logprobs(kept)
    metrics = trainer.step(kept, objective="likelihood")
    assert train_keys(metrics) == TRAIN_KEYS and metrics["train/clip_frac"] == 0.0
    # token-mean aggregation: the loss is the mean negative logprob of the kept tokens
    flat = [x for row in before for x in row]
    assert metrics["train/loss"] == pytest.approx(-sum(flat) / len(flat), rel=1e-5)
    after = trainer.response_logprobs(kept)
    assert sum(map(sum, after)) > sum(map(sum, before)) + 0.5
    assert trainer.version == 1


def test_the_likelihood_step_needs_no_recorded_logprobs_and_micro_batches_alike():
    kept = filtered(recorded_batch(None, far=True), OfflineConfig())
    bare = [t.model_copy(update={"response_logprobs": []}) for t in kept]
    small, whole = LoRATrainer(config(micro_batch_tokens=12)), LoRATrainer(config())
    assert len(small._micro_batches(small._rows(bare, merge=False))) > 1
    a, b = small.step(bare, objective="likelihood"), whole.step(kept, objective="likelihood")
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
    for name, p in small.lora_state().items():
        assert torch.allclose(p, whole.lora_state()[name], atol=1e-6)
    with pytest.raises(InvalidInput, match="behaviour logprob"):
        small.step(bare)  # the policy gradient needs them
    with pytest.raises(InvalidInput, match="unknown objective"):
        small.step(kept, objective="sft")


def test_an_importance_step_moves_the_policy_along_the_advantage():
    trainer = LoRATrainer(config())
    batch = recorded_batch(trainer)
    advantage = {e["rollout_id"]: e["advantage"] for e in batch.episodes}
    assert advantage == {"ep-good": 0.5, "ep-bad": -0.5, "ep-meh": 0.0}
    before = by_episode(trainer, batch)
    metrics = trainer.step(batch.transitions)
    assert train_keys(metrics) == TRAIN_KEYS
    after = by_episode(trainer, batch)
    assert after["ep-good"] > before["ep-good"] + 0.5
    assert after["ep-bad"] < before["ep-bad"] - 0.5
    # The policy moved away from the recorded one: the gap is no longer 0.
    assert trainer.behaviour_gap(batch.transitions)["offline/behaviour_kl"] > 1e-6


def nudged(batch: OfflineBatch) -> list[Transition]:
    """The batch's transitions with an advantage, their recorded logprobs moved a little (by
    +-0.1, +-0.4 per token): a behaviour policy near the current one but not it."""
    out = []
    for t in batch.transitions:
        if t.advantage:
            shift = [(0.1, -0.4, 0.4, -0.1)[i % 4] for i in range(len(t.response_logprobs))]
            moved = [x + d for x, d in zip(t.response_logprobs, shift, strict=True)]
            out.append(t.model_copy(update={"response_logprobs": moved}))
    return out


def test_a_gated_step_measures_the_gap_in_its_own_pass_and_equals_measuring_first():
    # Two trainers from the same seed: one measures then steps, the other gates one pass.
    first, gated = LoRATrainer(config()), LoRATrainer(config())
    assert first.dropout_free() and gated.dropout_free()
    learning = nudged(recorded_batch(first))
    gap = first.behaviour_gap(learning)
    assert 0.01 < gap["offline/behaviour_kl"] < 0.05 and gap["offline/outside_clip"] > 0
    stepped = first.step(learning)
    seen: list[dict[str, float]] = []
    found, metrics = gated.gated_step(learning, lambda g: seen.append(g) or True)
    assert seen == [found]
    assert found == pytest.approx(gap, abs=1e-5)
    assert metrics is not None and metrics["train/loss"] == pytest.approx(stepped["train/loss"])
    assert gated.version == first.version == 1
    for name, p in gated.lora_state().items():
        assert torch.allclose(p, first.lora_state()[name], atol=1e-6)


def test_a_refused_gated_step_changes_nothing_and_dropout_measures_first():
    trainer = LoRATrainer(config())
    lora = trainer.lora_state()
    learning = nudged(recorded_batch(trainer))
    gap, metrics = trainer.gated_step(learning, lambda g: False)
    assert metrics is None and gap["offline/tokens"] == sum(
        len(t.response_token_ids) for t in learning
    )
    assert trainer.version == 0 and all(p.grad is None for p in trainer.params)
    assert all(torch.equal(lora[n], p) for n, p in trainer.lora_state().items())
    # With dropout on the LoRA path a train-mode pass is not the eval-mode policy: the gap is
    # behaviour_gap's own pass, then the step.
    noisy = LoRATrainer(config(lora={"dropout": 0.5}))
    assert not noisy.dropout_free()
    expected = noisy.behaviour_gap(learning)
    gap, metrics = noisy.gated_step(learning, lambda g: True)
    assert gap == expected and metrics is not None and noisy.version == 1


def test_the_offline_task_gates_its_one_update_by_the_gap(prefect_harness, tmp_path):
    from lightning_rl.gpu_slot import ensure_gpu_limit
    from lightning_rl.tasks.training import train_offline

    ensure_gpu_limit()  # the task holds the Prefect server's GPU slot while it trains
    cfg = config()
    own = recorded_batch(LoRATrainer(cfg))  # the task's new adapter starts from the same seed
    near = train_offline.fn(cfg, own, None, str(tmp_path / "near"), OfflineConfig())
    assert near["offline/filtered"] == 0.0 and near["offline/behaviour_kl"] < 1e-6
    # The three calls with an advantage (ep-meh's is 0): the gap is measured on what trains.
    assert near["train/transitions"] == 3 and near["offline/tokens"] == 12
    assert (tmp_path / "near" / ADAPTER_CONFIG).exists()

    far = train_offline.fn(
        cfg, recorded_batch(None, far=True), None, str(tmp_path / "far"), OfflineConfig()
    )
    assert far["offline/filtered"] == 1.0 and far["offline/behaviour_kl"] > 5
    assert far["train/transitions"] == 2 and far["train/clip_frac"] == 0.0  # ep-good's calls
