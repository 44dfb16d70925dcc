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

Aggregation over a batch of sequences (mask marks response tokens; a sequence is one LLM call,
its transition). Written as one weight w_i per sequence i of length L_i, loss = sum_i w_i *
sum_t l_(i,t) over N sequences of R rollouts (`sequence_weights`):
- token-mean: w_i = 1 / sum_j L_j; every token weighs the same (long answers weigh more);
- seq-mean-token-sum: w_i = 1 / N; sum over each sequence's tokens, mean over sequences;
- seq-mean-token-mean: w_i = 1 / (N L_i); GRPO's original;
- seq-mean-token-sum-norm: w_i = 1 / (N C) for a constant C (`loss_norm_tokens`): Dr. GRPO's
  unbiased form, no division by each sequence's own length (with `normalize_std` off, credit
  assignment does not divide advantages by the group's spread either);
- rollout-mean: w_i = 1 / (R T_r(i)), T_r the response tokens of i's rollout: the token mean
  within each rollout, then the mean over rollouts, so every rollout weighs the same whatever
  its number of calls and tokens.

Further objectives, each a setting (config.py):
- GSPO sequence ratio (`importance_ratio="sequence"`): s_i = exp(mean_t (log pi(y_t) - log
  pi_old(y_t))), the geometric mean of sequence i's token ratios, clipped at sequence level:
  l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)), the same for each of its
  tokens (with seq-mean-token-mean, exactly GSPO's objective).
- Ratio masking (`ratio_mask=k`, IcePop-style): a token whose behaviour ratio pi / pi_old lies
  outside [1/k, k] gets no gradient (its loss term is 0; the denominators stay).
- Overlong filtering (trainer.py): a call cut at its token limit gets weight 0 and leaves the
  denominators, since its truncated answer's reward says nothing about the answer itself.

The likelihood loss (reward-filtered fine-tuning of offline data, see offline.py) is the mean
negative log-likelihood of the response tokens, aggregated the same ways and with the same
optional KL penalty: no ratio, no advantage, every kept token pulled up alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_core.algo.config import Aggregation, ImportanceRatio


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
    # The fraction of response tokens ratio masking took out of the gradient.
    ratio_masked_frac: float = 0.0


def sequence_weights(
    lengths: Sequence[int],
    rollouts: Sequence[str],
    mode: Aggregation,
    norm_tokens: int = 1,
) -> list[float]:
    """Each sequence's weight w_i in loss = sum_i w_i * sum_t l_(i,t) (module doc), from the
    sequences' response lengths and the rollout each belongs to. A sequence of length 0 (one
    filtered out) weighs 0 and counts in no denominator."""
    kept = [i for i, n in enumerate(lengths) if n > 0]
    out = [0.0] * len(lengths)
    if not kept:
        return out
    n = len(kept)
    if mode == "rollout-mean":
        per_rollout: dict[str, int] = {}
        for i in kept:
            per_rollout[rollouts[i]] = per_rollout.get(rollouts[i], 0) + lengths[i]
        for i in kept:
            out[i] = 1.0 / (len(per_rollout) * per_rollout[rollouts[i]])
        return out
    total = sum(lengths[i] for i in kept)
    for i in kept:
        if mode == "token-mean":
            out[i] = 1.0 / total
        elif mode == "seq-mean-token-sum":
            out[i] = 1.0 / n
        elif mode == "seq-mean-token-mean":
            out[i] = 1.0 / (n * lengths[i])
        elif mode == "seq-mean-token-sum-norm":
            out[i] = 1.0 / (n * norm_tokens)
        else:
            raise ValueError(f"unknown aggregation {mode!r}")
    return out


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation, norm_tokens: int = 1
) -> torch.Tensor:
    """The loss of one [batch, tokens] tensor whose rows are whole sequences of one rollout
    each (the trainer weighs across micro-batches and rollouts with `sequence_weights`)."""
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    per_seq = (per_token * mask).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return per_seq.mean()
    if mode == "seq-mean-token-sum-norm":
        return per_seq.mean() / norm_tokens
    if mode in ("seq-mean-token-mean", "rollout-mean"):
        return (per_seq / mask.sum(dim=-1).clamp(min=1.0)).mean()
    raise ValueError(f"unknown aggregation {mode!r}")


def sequence_mean(values: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Per position, the mean of `values` over the positions of its sequence. `segments` numbers
    each response position's sequence (0..S-1; -1 elsewhere), so several sequences may share a
    row (prefix merging, trainer.py); positions outside any sequence get 0."""
    inside = segments >= 0
    index = segments.clamp(min=0)[inside]
    count = int(segments.max()) + 1 if inside.any() else 0
    sums = values.new_zeros(count).index_add(0, index, values[inside])
    counts = values.new_zeros(count).index_add(0, index, torch.ones_like(values[inside]))
    means = sums / counts.clamp(min=1.0)
    return torch.where(inside, means[segments.clamp(min=0)], values.new_zeros(()))


def _row_segments(mask: torch.Tensor) -> torch.Tensor:
    # Unmerged rows: each row is one sequence.
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    return torch.where(mask.bool(), rows, -1)


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
    importance_ratio: ImportanceRatio = "token",
    ratio_mask: float | None = None,
    weights: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> LossOutput:
    """PPO-clip loss over [batch, tokens] tensors; advantages broadcast per token. With
    `tis_cap`, clipped against the proximal policy and weighted by the truncated ratio to the
    behaviour policy; with `importance_ratio="sequence"`, GSPO's ratio; with `ratio_mask`,
    tokens far off the behaviour policy masked (module doc). `weights` (per token, zero outside
    the mask) replaces `aggregation` by the sum of the weighted token losses; `segments`
    numbers the sequences when rows hold several (`sequence_mean`)."""
    mask = mask.to(logprobs.dtype)
    behaviour_ratio = torch.exp(logprobs.detach() - old_logprobs)
    if tis_cap is None:
        log_ratio, weight = logprobs - old_logprobs, None
    else:
        log_ratio = logprobs - logprobs.detach()
        weight = behaviour_ratio.clamp(max=tis_cap)
    if importance_ratio == "sequence":
        log_ratio = sequence_mean(log_ratio, _row_segments(mask) if segments is None else segments)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if weight is not None:
        per_token = per_token * weight
    kept = mask
    if ratio_mask is not None:
        inside = (behaviour_ratio >= 1.0 / ratio_mask) & (behaviour_ratio <= ratio_mask)
        kept = mask * inside.to(mask.dtype)
        per_token = per_token * inside.to(per_token.dtype)
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
        masked_frac = float((mask - kept).sum() / tokens)
    loss = (
        aggregate(per_token, mask, aggregation) if weights is None else (per_token * weights).sum()
    )
    return LossOutput(loss, clip_frac, kl_value, ratio_mean, ratio_max, truncated, masked_frac)


def likelihood_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """Negative log-likelihood of the masked tokens over [batch, tokens] tensors; `weights` as
    in policy_loss.

    Nothing is clipped and every token weighs 1, so clip_frac is 0 and ratio_mean 1."""
    mask = mask.to(logprobs.dtype)
    per_token, kl_value = _kl_penalty(-logprobs, logprobs, mask, ref_logprobs, kl_coef)
    loss = (
        aggregate(per_token, mask, aggregation) if weights is None else (per_token * weights).sum()
    )
    return LossOutput(loss, 0.0, kl_value, 1.0)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy of the policy over response tokens (a metric: it is not optimised)."""
    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        return float(aggregate(entropy, mask, "token-mean"))
