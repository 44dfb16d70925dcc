"""Configuration of the LoRA policy-gradient trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# How token losses are averaged over a batch, and which importance ratio clips (losses.py says
# how each weighs). Here, not in losses.py, so that reading a config never imports torch (the
# CLI's start, its errors).
Aggregation = Literal[
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "rollout-mean",
]
ImportanceRatio = Literal["token", "sequence"]


class LoRAConfig(BaseModel):
    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names that get adapters (attention projections by default).",
    )
    top_layers: int | None = Field(
        None,
        ge=1,
        description="Adapt only the last N transformer layers; None adapts all. Backward then "
        "stops below them, which makes a step much cheaper on CPU.",
    )


class TrainerConfig(BaseModel):
    """One policy-gradient update per batch of transitions, on a LoRA adapter."""

    model: str | None = Field(
        None, description="Base model folder or hub id; None: SmolLM2-135M-Instruct."
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    micro_batch_tokens: int = Field(
        1024,
        ge=1,
        description="Token budget of one forward (prompt + response, padding included); the "
        "batch is split into micro-batches that fit and their gradients accumulated, and a "
        "call longer than it is a micro-batch of its own. A step's memory grows with it: on "
        "CPU, SmolLM2-135M with every layer adapted peaks at 3.2 GiB with 1024, 5.6 with "
        "2048 (BENCHMARKS.md); the GPU preset raises it.",
    )
    max_call_tokens: int = Field(
        65536,
        ge=1,
        description="Longest call (prompt + response tokens) trained on: collecting drops a "
        "rollout with a longer one (counted as call_too_long), so no update meets it. The "
        "default is the longest call the gateway's default limits let through "
        "(max_prompt_tokens + max_generation_tokens); lower it to what a step's memory holds.",
    )
    clip_low: float = Field(0.2, ge=0, description="PPO clip below 1 (ratio >= 1 - clip_low).")
    clip_high: float = Field(
        0.28, ge=0, description="PPO clip above 1; larger than clip_low is clip-higher (DAPO)."
    )
    aggregation: Aggregation = Field(
        "token-mean",
        description="How token losses are averaged (losses.py): token-mean (every token alike), "
        "seq-mean-token-sum, seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO: "
        "divided by loss_norm_tokens, not by each call's length), rollout-mean (every rollout "
        "alike, whatever its number of calls and tokens).",
    )
    loss_norm_tokens: int = Field(
        1024,
        ge=1,
        description="The constant C that seq-mean-token-sum-norm divides each call's token sum "
        "by (Dr. GRPO uses the generation budget); other aggregations ignore it.",
    )
    importance_ratio: ImportanceRatio = Field(
        "token",
        description="token: PPO's per-token ratio. sequence: GSPO's, the geometric mean of a "
        "call's token ratios, clipped per call (GSPO clips tightly: clip_low 3e-4, clip_high "
        "4e-4).",
    )
    ratio_mask: float | None = Field(
        None,
        gt=1,
        description="Ratio masking (IcePop-style): response tokens whose ratio to the behaviour "
        "logprobs lies outside [1/k, k] get no policy-gradient term (the KL penalty stays; "
        "train/ratio_masked_frac counts them). None: no masking.",
    )
    overlong_filter: bool = Field(
        False,
        description="Calls cut at their token limit (finish reason 'length') get no loss and "
        "leave the denominators (DAPO): their reward judges an answer that was never finished "
        "(train/overlong_frac counts them).",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling: weight each token by its ratio to the "
        "behaviour policy that sampled it, capped here, and clip PPO's ratio against the policy "
        "at the start of the update instead (losses.py). None: PPO-clip directly against the "
        "behaviour logprobs, right for fresh rollouts. The train flow uses 2.0 when staleness "
        "> 0 and this is not set.",
    )
    prefix_merge: bool = Field(
        True,
        description="Train consecutive calls of one agent whose prompt extends the previous "
        "call's prompt + response in one forward pass over the last call (prefix.py); each "
        "call keeps its own advantage, logprobs and weight, so the update is the same, "
        "computed once for the shared prefix.",
    )
    prefix_share: bool = Field(
        True,
        description="Rows of a micro-batch that begin with the same tokens (a group's calls on "
        "one task send one prompt) compute them once: one forward over the shared prefix, "
        "whose keys and values each row's rest attends to (shared_prefix.py); the update is the "
        "same. Off with gradient checkpointing or replayed frozen activations.",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="KL penalty to the base model (adapter disabled); 0 to skip it."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward: less memory, ~1/3 more compute."
    )
    device: str | None = Field(None, description="torch device; None: CUDA when available.")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="None: float32 on CPU, bfloat16 on CUDA."
    )
    seed: int = Field(0, description="Seeds adapter initialisation and dropout.")
    data_parallel: int = Field(
        1,
        ge=1,
        description="Processes that share each train-policy update (torch.distributed data "
        "parallel: each backpropagates its share of the batch and the gradients are summed; "
        "gloo on CPU, NCCL with one GPU per process). 1: one process, in the flow's own. The "
        "saved adapter is the same either way; offline training runs in one process.",
    )
