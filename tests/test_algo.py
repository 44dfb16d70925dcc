"""LightningRL's pure parts against hand-computed values: credit, advantages, losses."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_core.algo.advantages import Episode, compute_advantages
from lightning_core.algo.credit import assign_credit
from lightning_core.algo.losses import aggregate, entropy_from_logits, policy_loss
from lightning_core.errors import InvalidInput

# ---------------------------------------------------------------------------- credit


def test_equal_credit_gives_every_action_the_episode_return():
    assert assign_credit([0.0, 0.5, 1.0], "equal") == [1.5, 1.5, 1.5]


def test_last_credit_gives_only_the_final_action_the_return():
    assert assign_credit([0.0, 0.5, 1.0], "last") == [0.0, 0.0, 1.5]


def test_discounted_credit_is_return_to_go():
    # G2 = 1; G1 = 0.5 + 0.9 * 1 = 1.4; G0 = 0 + 0.9 * 1.4 = 1.26
    assert assign_credit([0.0, 0.5, 1.0], "discounted", gamma=0.9) == pytest.approx(
        [1.26, 1.4, 1.0]
    )
    assert assign_credit([0.0, 0.5, 1.0], "discounted", gamma=1.0) == [1.5, 1.5, 1.0]


def test_a_custom_credit_function_plugs_in():
    def halve(rewards):
        return [r / 2 for r in rewards]

    assert assign_credit([1.0, 3.0], halve) == [0.5, 1.5]
    with pytest.raises(InvalidInput):
        assign_credit([1.0, 3.0], lambda rewards: [1.0])


def test_credit_edge_cases():
    assert assign_credit([], "equal") == []
    assert assign_credit([2.0], "last") == [2.0]
    with pytest.raises(InvalidInput):
        assign_credit([1.0], "discounted", gamma=1.5)
    with pytest.raises(InvalidInput):
        assign_credit([1.0], "sideways")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- advantages


def episodes(group: str, returns: list[float], actions: int = 2) -> list[Episode]:
    return [Episode(group, r, [r] * actions) for r in returns]


def test_grpo_subtracts_the_group_mean():
    adv = compute_advantages(episodes("g", [1.0, 0.0, 0.0, 1.0]), "grpo")
    assert adv == [[0.5, 0.5], [-0.5, -0.5], [-0.5, -0.5], [0.5, 0.5]]


def test_grpo_with_std_normalisation():
    # mean 0.5, population std 0.5: advantages +-1 (up to EPS)
    adv = compute_advantages(episodes("g", [1.0, 0.0], 1), "grpo", normalize_std=True)
    assert adv == [[pytest.approx(1.0, abs=1e-5)], [pytest.approx(-1.0, abs=1e-5)]]


def test_rloo_uses_the_other_rollouts_as_baseline():
    # returns 1, 0, 0.5: baselines (0 + 0.5)/2 = 0.25, (1 + 0.5)/2 = 0.75, (1 + 0)/2 = 0.5
    adv = compute_advantages(episodes("g", [1.0, 0.0, 0.5], 1), "rloo")
    assert adv == [[0.75], [-0.75], [0.0]]


def test_groups_are_independent_and_all_equal_groups_give_zero_never_nan():
    batch = episodes("a", [1.0, 1.0, 1.0]) + episodes("b", [2.0, 0.0]) + episodes("c", [5.0])
    for estimator in ("grpo", "rloo"):
        for normalize in (False, True):
            adv = compute_advantages(batch, estimator, normalize_std=normalize)
            flat = [x for row in adv for x in row]
            assert not any(math.isnan(x) for x in flat)
            assert adv[0] == adv[1] == adv[2] == [0.0, 0.0]  # all equal
            assert adv[5] == [0.0, 0.0]  # a single rollout
            assert adv[3][0] > 0 > adv[4][0]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++"])
def test_a_groups_rollouts_in_any_order_get_the_same_advantages_to_the_last_bit(estimator):
    # A group's rollouts come back in the order of their random ids. Summed left to right,
    # these returns give a mean whose last bit depends on the order.
    returns = [0.61, 0.61, 0.58, 0.16]
    batch = [Episode("g", r, [r]) for r in returns]
    forward = compute_advantages(batch, estimator, normalize_std=True)
    backward = compute_advantages(batch[::-1], estimator, normalize_std=True)[::-1]
    assert forward == backward


def test_reinforce_plus_plus_normalises_over_the_batch():
    batch = [Episode("a", 1.0, [1.0, 3.0]), Episode("b", 0.0, [0.0, 0.0])]
    # returns 1, 3, 0, 0: mean 1, std sqrt((0 + 4 + 1 + 1) / 4) = sqrt(1.5)
    s = math.sqrt(1.5)
    adv = compute_advantages(batch, "reinforce++")
    assert adv == [[pytest.approx(0.0), pytest.approx(2 / s)], [-1 / s, -1 / s]]
    assert compute_advantages([Episode("a", 1.0, [1.0, 1.0])], "reinforce++") == [[0.0, 0.0]]


def test_action_returns_keep_their_per_step_credit():
    # Discounted credit: actions of one episode differ; the baseline is the group's mean return.
    batch = [Episode("g", 1.0, [0.81, 0.9, 1.0]), Episode("g", 0.0, [0.0, 0.0, 0.0])]
    adv = compute_advantages(batch, "grpo")
    assert adv[0] == pytest.approx([0.31, 0.4, 0.5]) and adv[1] == [-0.5, -0.5, -0.5]


# ---------------------------------------------------------------------------- losses


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_on_policy_loss_is_minus_the_mean_advantage_with_gradient_of_the_logprobs():
    logprobs = _t([[-1.0, -2.0], [-0.5, -0.5]]).requires_grad_()
    adv = _t([[1.0, 1.0], [-2.0, -2.0]])
    mask = _t([[1, 1], [1, 0]])
    out = policy_loss(logprobs, logprobs.detach(), adv, mask)
    # ratio 1 everywhere: loss = mean over the 3 tokens of -A = -(1 + 1 - 2)/3 = 0
    assert float(out.loss.detach()) == pytest.approx(0.0)
    out.loss.backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A, over 3 tokens; masked token gets 0
    expected = torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]], dtype=torch.float64)
    assert torch.allclose(logprobs.grad, expected)
    assert out.clip_frac == 0.0 and out.ratio_mean == pytest.approx(1.0)


def test_clipping_is_asymmetric_and_counted():
    old = _t([[0.0, 0.0, 0.0]])
    # ratios e^0.5 = 1.65 (A > 0: clipped to 1 + clip_high), e^-0.5 = 0.61 (A < 0: clipped to
    # 1 - clip_low), e^0.1 = 1.105 (inside both bounds)
    new = _t([[0.5, -0.5, 0.1]])
    adv = _t([[1.0, -1.0, 1.0]])
    mask = _t([[1, 1, 1]])
    out = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    expected = (-1.28 + 0.8 - math.exp(0.1)) / 3
    assert float(out.loss) == pytest.approx(expected)
    assert out.clip_frac == pytest.approx(2 / 3)


def test_stale_rollouts_are_importance_weighted():
    old, new = _t([[-1.0]]), _t([[-0.9]])
    out = policy_loss(new, old, _t([[2.0]]), _t([[1.0]]), clip_low=0.5, clip_high=0.5)
    assert float(out.loss) == pytest.approx(-2.0 * math.exp(0.1))


def test_truncated_importance_sampling_keeps_teaching_stale_tokens_and_caps_their_weight():
    # Rollouts sampled one version ago: the current policy has moved these tokens to ratios
    # e^0.5 = 1.65 (A > 0) and e^1.5 = 4.48 (A > 0), beyond PPO's clip range.
    old = _t([[0.0, 0.0]])
    mask = _t([[1, 1]])
    adv = _t([[1.0, 1.0]])
    plain = _t([[0.5, 1.5]]).requires_grad_()
    policy_loss(plain, old, adv, mask, clip_high=0.28).loss.backward()
    # Against the behaviour logprobs alone, both are clipped: no gradient, nothing learned.
    assert torch.equal(plain.grad, torch.zeros_like(plain.grad))
    tis = _t([[0.5, 1.5]]).requires_grad_()
    out = policy_loss(tis, old, adv, mask, clip_high=0.28, tis_cap=2.0)
    out.loss.backward()
    # Clipped against the proximal policy (ratio 1: inside), weighted by the behaviour ratio,
    # the second capped at 2: d/dlogp = -A * w / tokens.
    expected = torch.tensor([[-math.exp(0.5) / 2, -2.0 / 2]], dtype=torch.float64)
    assert torch.allclose(tis.grad, expected)
    assert float(out.loss) == pytest.approx(-(math.exp(0.5) + 2.0) / 2)
    assert out.clip_frac == 0.0 and out.truncated_frac == pytest.approx(0.5)
    assert out.ratio_mean == pytest.approx((math.exp(0.5) + math.exp(1.5)) / 2)
    assert out.ratio_max == pytest.approx(math.exp(1.5))


def test_truncated_importance_sampling_on_fresh_rollouts_is_the_plain_policy_gradient():
    logprobs = _t([[-1.0, -2.0], [-0.5, -0.5]])
    adv = _t([[1.0, 1.0], [-2.0, -2.0]])
    mask = _t([[1, 1], [1, 0]])
    grads = []
    for cap in (None, 2.0):
        x = logprobs.clone().requires_grad_()
        out = policy_loss(x, logprobs, adv, mask, tis_cap=cap)
        out.loss.backward()
        grads.append(x.grad)
        assert out.truncated_frac == 0.0 and out.ratio_max == pytest.approx(1.0)
    assert torch.allclose(grads[0], grads[1])


def test_aggregations():
    per_token = _t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = _t([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)


def test_kl_to_the_reference_is_k3_and_penalises():
    new, ref = _t([[-1.0, -2.0]]), _t([[-1.5, -2.0]])
    mask = _t([[1, 1]])
    delta = -0.5
    k3 = math.exp(delta) - delta - 1
    out = policy_loss(new, new, _t([[0.0, 0.0]]), mask, ref_logprobs=ref, kl_coef=0.1)
    assert out.kl == pytest.approx(k3 / 2)
    assert float(out.loss) == pytest.approx(0.1 * k3 / 2)
    assert policy_loss(new, new, _t([[0.0, 0.0]]), mask, ref_logprobs=new).kl == 0.0


def test_entropy_metric():
    uniform = torch.zeros(1, 2, 4)
    assert entropy_from_logits(uniform, torch.ones(1, 2)) == pytest.approx(math.log(4))
    peaked = torch.tensor([[[100.0, 0.0, 0.0, 0.0]]])
    assert entropy_from_logits(peaked, torch.ones(1, 1)) == pytest.approx(0.0, abs=1e-6)
