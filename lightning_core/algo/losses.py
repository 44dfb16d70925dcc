"""Token-level policy-gradient losses: PPO-clip / GRPO with the behaviour policy's logprobs.

The importance ratio is taken against the logprobs recorded at rollout time, so stale rollouts
(sampled by an older policy version) are corrected rather than trusted or thrown away. Clipping
may be asymmetric (clip-higher: a larger upper bound keeps low-probability tokens learnable).

With a truncation cap (`tis_cap`, truncated importance sampling as in TIS and decoupled PPO), the
two roles of that ratio are split: PPO's clip is taken against the proximal policy, the weights
at the start of the update, and each token's term is weighted by its ratio to the behaviour
policy, proximal / behaviour, capped at `tis_cap` and not differentiated. Rollouts a version or
two stale (concurrent rollouts and training) then still teach: against the behaviour logprobs
alone, a token the last update moved outside the clip range gets no gradient at all. Every
transition is trained in exactly one optimizer step, so the proximal logprobs are the current
ones, detached: no second forward pass.
An optional KL penalty to the reference policy uses the k3 estimator, exp(q - p) - (q - p) - 1,
which is unbiased and never negative; the reference logprobs come from the same model with the
LoRA adapter disabled, so no second copy of the model is needed.

Aggregation over a batch of sequences (mask marks response tokens):
- token-mean: every token weighs the same (long answers weigh more);
- seq-mean-token-sum: sum over each sequence's tokens, mean over sequences;
- seq-mean-token-mean: mean over each sequence's tokens, then over sequences (GRPO's original).

The likelihood loss (reward-filtered fine-tuning of offline data, see offline.py) is the mean
negative log-likelihood of the response tokens, aggregated the same ways and with the same
optional KL penalty: no ratio, no advantage, every kept token pulled up alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_core.algo.config import Aggregation


@dataclass
class LossOutput:
    loss: torch.Tensor
    clip_frac: float
    kl: float
    ratio_mean: float
    # The importance ratio to the behaviour policy (the current one over the recorded logprobs),
    # over response tokens: its largest value, and the fraction of tokens tis_cap truncated.
    ratio_max: float = 1.0
    truncated_frac: float = 0.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    per_seq = (per_token * mask).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return per_seq.mean()
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=-1).clamp(min=1.0)).mean()
    raise ValueError(f"unknown aggregation {mode!r}")


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(q || p) from samples of q, given log(p / q) at them."""
    return torch.exp(log_ratio) - log_ratio - 1.0


def _kl_penalty(
    per_token: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
) -> tuple[torch.Tensor, float]:
    """The per-token loss with the KL penalty to the reference added, and the mean KL."""
    if ref_logprobs is None:
        return per_token, 0.0
    kl = k3(ref_logprobs - logprobs)
    kl_value = float(aggregate(kl.detach(), mask, "token-mean"))
    if kl_coef:
        per_token = per_token + kl_coef * kl
    return per_token, kl_value


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: Aggregation = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    tis_cap: float | None = None,
) -> LossOutput:
    """PPO-clip loss over [batch, tokens] tensors; advantages broadcast per token. With
    `tis_cap`, clipped against the proximal policy and weighted by the truncated ratio to the
    behaviour policy (module doc)."""
    mask = mask.to(logprobs.dtype)
    behaviour_ratio = torch.exp(logprobs.detach() - old_logprobs)
    if tis_cap is None:
        ratio, weight = torch.exp(logprobs - old_logprobs), None
    else:
        ratio = torch.exp(logprobs - logprobs.detach())
        weight = behaviour_ratio.clamp(max=tis_cap)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if weight is not None:
        per_token = per_token * weight
    per_token, kl_value = _kl_penalty(per_token, logprobs, mask, ref_logprobs, kl_coef)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)
        was_clipped = (clipped > unclipped).to(mask.dtype)
        clip_frac = float((was_clipped * mask).sum() / tokens)
        ratio_mean = float((behaviour_ratio * mask).sum() / tokens)
        ratio_max = float(torch.where(mask.bool(), behaviour_ratio, 0.0).max())
        truncated = 0.0
        if tis_cap is not None:
            truncated = float(((behaviour_ratio > tis_cap).to(mask.dtype) * mask).sum() / tokens)
    return LossOutput(
        aggregate(per_token, mask, aggregation),
        clip_frac,
        kl_value,
        ratio_mean,
        ratio_max,
        truncated,
    )


def likelihood_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossOutput:
    """Negative log-likelihood of the masked tokens over [batch, tokens] tensors.

    Nothing is clipped and every token weighs 1, so clip_frac is 0 and ratio_mean 1."""
    mask = mask.to(logprobs.dtype)
    per_token, kl_value = _kl_penalty(-logprobs, logprobs, mask, ref_logprobs, kl_coef)
    return LossOutput(aggregate(per_token, mask, aggregation), 0.0, kl_value, 1.0)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy of the policy over response tokens (a metric: it is not optimised)."""
    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        return float(aggregate(entropy, mask, "token-mean"))
