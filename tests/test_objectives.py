"""The objectives as settings (losses.py), each against a hand computation, and the trainer's
weighting of them over a whole batch (overlong filtering, rollout-mean across micro-batches)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.losses import policy_loss, sequence_mean, sequence_weights
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.models import tiny_model_dir
from lightning_core.types import Transition

# Three calls: two of rollout a (2 and 3 response tokens), one of rollout b (4 tokens).
LENGTHS, ROLLOUTS = [2, 3, 4], ["a", "a", "b"]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", [1 / 9, 1 / 9, 1 / 9]),
        ("seq-mean-token-sum", [1 / 3, 1 / 3, 1 / 3]),
        ("seq-mean-token-mean", [1 / 6, 1 / 9, 1 / 12]),
        # Dr. GRPO: a constant C = 8 instead of each call's length.
        ("seq-mean-token-sum-norm", [1 / 24, 1 / 24, 1 / 24]),
        # Rollout a has 5 tokens, b has 4, two rollouts: each rollout's tokens share 1/2.
        ("rollout-mean", [1 / 10, 1 / 10, 1 / 8]),
    ],
)
def test_sequence_weights_by_hand(mode, expected):
    assert sequence_weights(LENGTHS, ROLLOUTS, mode, norm_tokens=8) == pytest.approx(expected)


def test_a_filtered_call_weighs_nothing_and_leaves_the_denominators():
    assert sequence_weights([0, 3, 4], ROLLOUTS, "token-mean") == pytest.approx([0, 1 / 7, 1 / 7])
    # Rollout a is only its 3-token call now.
    assert sequence_weights([0, 3, 4], ROLLOUTS, "rollout-mean") == pytest.approx([0, 1 / 6, 1 / 8])


def test_rollout_mean_is_the_mean_over_rollouts_of_their_token_means():
    # Token losses of each call, written out; the loss by its definition, in plain Python.
    losses = [[1.0, 3.0], [2.0, 2.0, 5.0], [4.0, 0.0, 0.0, 8.0]]
    by_rollout = {"a": losses[0] + losses[1], "b": losses[2]}
    expected = sum(sum(v) / len(v) for v in by_rollout.values()) / len(by_rollout)
    weights = sequence_weights(LENGTHS, ROLLOUTS, "rollout-mean")
    got = sum(w * sum(call) for w, call in zip(weights, losses, strict=True))
    assert got == pytest.approx(expected)  # (13/5 + 3) / 2 = 2.8
    assert expected == pytest.approx(2.8)


def test_sequence_mean_handles_several_sequences_in_one_row():
    values = torch.tensor([[1.0, 2.0, 4.0, 9.0], [3.0, 5.0, 0.0, 0.0]])
    segments = torch.tensor([[0, 0, 1, -1], [2, 2, -1, -1]])
    out = sequence_mean(values, segments)
    assert out.tolist() == [[1.5, 1.5, 4.0, 0.0], [4.0, 4.0, 0.0, 0.0]]


def test_gspo_ratio_is_the_geometric_mean_clipped_per_sequence():
    # Sequence 0: log-ratios 0.2 and -0.4 (mean -0.1); sequence 1: 0.3 (one token).
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.2, -0.4], [0.3, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.ones(2, 2)
    out = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        aggregation="seq-mean-token-mean",
        importance_ratio="sequence",
    )
    s0, s1 = math.exp(-0.1), math.exp(0.3)
    assert s1 > 1.28  # sequence 1 is clipped: -1.28, no gradient
    assert float(out.loss.detach()) == pytest.approx((-s0 - 1.28) / 2, abs=1e-6)
    out.loss.backward()
    # d/d logp_t of -(1/2) exp(mean_t logp_t) over sequence 0's two tokens: -(1/2) s0 (1/2).
    assert logp.grad.tolist()[0] == pytest.approx([-s0 / 4, -s0 / 4], abs=1e-6)
    assert logp.grad.tolist()[1] == [0.0, 0.0]
    assert out.clip_frac == pytest.approx(1 / 3)


def test_gspo_on_merged_rows_equals_gspo_on_separate_rows():
    logp = torch.tensor([[0.2, -0.4], [0.3, 0.0]])
    separate = policy_loss(
        logp, torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        importance_ratio="sequence", aggregation="seq-mean-token-mean",
    )  # fmt: skip
    merged = policy_loss(
        torch.tensor([[0.2, -0.4, 0.3]]),
        torch.zeros(1, 3),
        torch.ones(1, 3),
        torch.ones(1, 3),
        importance_ratio="sequence",
        weights=torch.tensor([[0.25, 0.25, 0.5]]),  # seq-mean-token-mean of calls of 2 and 1
        segments=torch.tensor([[0, 0, 1]]),
    )
    assert float(merged.loss) == pytest.approx(float(separate.loss), abs=1e-6)


def test_ratio_masking_drops_tokens_outside_one_over_k_to_k():
    # Behaviour ratios e^0.5 = 1.65, e^1 = 2.72, e^-1 = 0.37, 1; with k = 2 the middle two go.
    logp = torch.tensor([[0.5, 1.0, -1.0, 0.0]], requires_grad=True)
    wide = {"clip_low": 0.99, "clip_high": 10.0}  # no clipping: the ratio itself is the loss
    out = policy_loss(logp, torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4), **wide,
                      ratio_mask=2.0)  # fmt: skip
    assert float(out.loss.detach()) == pytest.approx(-(math.exp(0.5) + 1.0) / 4, abs=1e-6)
    assert out.ratio_masked_frac == pytest.approx(0.5)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-math.exp(0.5) / 4, 0.0, 0.0, -0.25])
    plain = policy_loss(logp, torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4), **wide)
    assert plain.ratio_masked_frac == 0.0
    assert float(plain.loss.detach()) < float(out.loss.detach()) - 0.5


def _call(rollout: str, prompt: list[int], response: list[int], adv: float, **extra) -> Transition:
    return Transition(
        rollout_id=rollout,
        step=extra.pop("step", 0),
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=[-6.0] * len(response),
        advantage=adv,
        **extra,
    )


def _config(**overrides) -> TrainerConfig:
    return TrainerConfig(model=str(tiny_model_dir()), learning_rate=1e-3, **overrides)


def _close(a: LoRATrainer, b: LoRATrainer, atol: float = 1e-6) -> bool:
    other = b.lora_state()
    return all(torch.allclose(p, other[n], atol=atol) for n, p in a.lora_state().items())


def test_overlong_filtering_trains_as_if_the_truncated_call_were_absent():
    kept = [
        _call("r0", [5, 6, 7, 8], [9, 10, 11], 1.0),
        _call("r1", [5, 6, 7], [12, 13], -1.0),
    ]
    cut = _call("r2", [5, 6, 7, 8, 9], [14, 15, 16, 17], 1.0, finish_reason="length")
    filtering = LoRATrainer(_config(overlong_filter=True))
    metrics = filtering.step([*kept, cut])
    assert metrics["train/overlong_frac"] == pytest.approx(1 / 3)
    without = LoRATrainer(_config())
    without.step(kept)
    assert _close(filtering, without)
    # Not filtered, the truncated call does move the weights.
    unfiltered = LoRATrainer(_config())
    unfiltered.step([*kept, cut])
    assert not _close(unfiltered, without)


def test_rollout_mean_micro_batched_equals_one_batch():
    # Rollout r0 has two calls of different lengths that land in different micro-batches.
    batch = [
        _call("r0", [5, 6, 7], [8, 9], 1.0),
        _call("r0", [20, 21, 22, 23, 24, 25, 26, 27], [28, 29, 30, 31], 1.0, step=1),
        _call("r1", [5, 7, 9, 11], [12], -1.0),
    ]
    small = LoRATrainer(_config(aggregation="rollout-mean", micro_batch_tokens=12))
    whole = LoRATrainer(_config(aggregation="rollout-mean"))
    assert len(small._micro_batches(small._rows(batch, False))) > 1
    a, b = small.step(batch), whole.step(batch)
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
    assert _close(small, whole)
