"""Named starting points for `lightning-rl train --preset NAME`.

A preset is a layer of TrainConfig fields under the --config file and the flags (which both win
over it), so `--preset gpu --model my/model` changes only the model. `cpu` is TrainConfig's own
defaults (SmolLM2-135M on the transformers backend, sized for a laptop CPU); `gpu` is sized for
one datacenter GPU (an H100/H200-class card, 80 GB or more) serving with vLLM.
"""

from __future__ import annotations

import copy
from typing import Any

from lightning_core.errors import LightningError

PRESETS: dict[str, dict[str, Any]] = {
    # The defaults, so that a run's command line can name its preset either way.
    "cpu": {},
    "gpu": {
        "server": {
            # 1.5B: large enough for multi-step agent tasks, small enough that vLLM and the
            # trainer share one card; the Instruct model already follows the chat templates
            # agents use.
            "model": "Qwen/Qwen2.5-1.5B-Instruct",
            "backend": "vllm",
        },
        # More rollouts per iteration: vLLM's continuous batching is cheap at high concurrency,
        # and larger groups give lower-variance group baselines.
        "rollouts": {
            "tasks_per_iteration": 64,
            "group_size": 8,
            "rollout_workers": 4,
            "rollout_concurrency": 64,
        },
        "trainer": {
            "dtype": "bfloat16",
            # One forward of 16k tokens fits a 1.5B model's activations in bf16 on such a card.
            "micro_batch_tokens": 16384,
            # All layers adapted (the CPU default adapts only the top 12 to keep backward short).
            "lora": {"top_layers": None},
        },
    },
}


def preset_fields(name: str) -> dict[str, Any]:
    """The TrainConfig fields preset `name` sets (a fresh copy); LightningError if unknown."""
    if name not in PRESETS:
        raise LightningError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
