"""The frozen layers' activations kept across updates on the same rows (algo/frozen.py): the
replayed passes give the same updates as whole ones, and the cache is used only where exact."""

from __future__ import annotations

import torch

from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.frozen import (
    FrozenActivations,
    batch_key,
    decoder,
    frozen_is_deterministic,
)
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.data.offline import OfflineConfig
from lightning_core.models import tiny_model_dir
from lightning_core.types import Transition
from tests.test_offline import recorded_batch


def config(**overrides) -> TrainerConfig:
    # The tiny model has two layers: the adapter on the top one, the bottom one frozen. A replay
    # turns shared prefixes off (its micro-batches are ordered by length); the whole passes
    # compared with it are ordered alike, so that both sum the gradients in the same order.
    settings = {
        "model": str(tiny_model_dir()),
        "learning_rate": 1e-2,
        "lora": {"top_layers": 1},
        "prefix_share": False,
    }
    return TrainerConfig(**(settings | overrides))


def transitions(seed: int = 0) -> list[Transition]:
    """Two episodes of two calls each, the second prompt extending the first call (merged into
    one row), and a single call; advantages of both signs; recorded logprobs a little off."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    out = []
    for e, advantage in enumerate((1.0, -0.5)):
        first, answer = ids(7), ids(3)
        for step, prompt in enumerate((first, [*first, *answer, *ids(2)])):
            response = answer if step == 0 else ids(4)
            out.append(
                Transition(
                    rollout_id=f"ep-{e}",
                    step=step,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_logprobs=[-7.0] * len(response),
                    advantage=advantage,
                )
            )
    single = ids(9)
    out.append(
        Transition(
            rollout_id="ep-2",
            step=0,
            prompt_token_ids=single,
            response_token_ids=ids(2),
            response_logprobs=[-7.0, -7.0],
            advantage=0.25,
        )
    )
    return out


def assert_same_adapter(a: LoRATrainer, b: LoRATrainer) -> None:
    theirs = a.lora_state()
    for name, p in b.lora_state().items():
        assert torch.allclose(p, theirs[name], atol=1e-6), name


def test_replayed_updates_equal_whole_ones_epoch_after_epoch():
    # The KL penalty's reference pass (adapter off) replays too; micro-batches of one row.
    cfg = config(kl_coef=0.1, micro_batch_tokens=16)
    whole, cached = LoRATrainer(cfg), LoRATrainer(cfg)
    cached.frozen = FrozenActivations(64)
    batch = transitions()
    for epoch in range(3):
        expected = whole.step(batch)
        # Another order of the same transitions: the same micro-batches, found again.
        got = cached.step(batch[::-1] if epoch % 2 else batch)
        assert got["train/frozen_replayed_frac"] == (0.5 if epoch == 0 else 1.0)
        assert "train/frozen_replayed_frac" not in expected
        assert abs(got["train/loss"] - expected["train/loss"]) < 1e-6
        assert abs(got["train/kl"] - expected["train/kl"]) < 1e-6
        assert_same_adapter(whole, cached)
    # Three rows, each a policy pass and a reference pass: 6 computed first, then replayed.
    assert (cached.computed, cached.replayed) == (3, 15)


def test_the_gap_and_the_gated_step_replay_alike():
    whole, cached = LoRATrainer(config()), LoRATrainer(config())
    cached.frozen = FrozenActivations(64)
    batch = transitions()
    assert cached.behaviour_gap(batch) == whole.behaviour_gap(batch)  # fills the cache
    gap, metrics = cached.gated_step(batch, lambda g: True)
    expected_gap, expected = whole.gated_step(batch, lambda g: True)
    assert metrics is not None and expected is not None
    assert metrics["train/frozen_replayed_frac"] == 1.0
    assert abs(gap["offline/behaviour_kl"] - expected_gap["offline/behaviour_kl"]) < 1e-6
    assert_same_adapter(whole, cached)
    other = transitions(seed=1)  # other tokens: computed, not replayed
    metrics = cached.step(other)
    assert metrics["train/frozen_replayed_frac"] == 0.0


def test_no_replay_where_it_would_not_be_exact():
    # The adapter on every layer: nothing below it to keep.
    assert LoRATrainer(config(lora={"top_layers": None}))._replay is None
    # Gradient checkpointing needs the embeddings' gradient hook, which a replay skips.
    assert LoRATrainer(config(gradient_checkpointing=True))._replay is None
    # Dropout in the frozen layers: their output differs from pass to pass.
    noisy = LoRATrainer(config())
    noisy.model.config.attention_dropout = 0.1
    assert not frozen_is_deterministic(decoder(noisy.model), 1)
    # Dropout on the LoRA path only (above the frozen layers) does not stop it.
    assert LoRATrainer(config(lora={"top_layers": 1, "dropout": 0.5}))._replay is not None


def test_the_cache_is_bounded_and_keyed_by_the_tokens():
    cache = FrozenActivations(1)  # 1 MiB: four 256 KiB entries
    block = torch.zeros(64, 1024)  # 256 KiB
    ids, attention = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]])
    keys = [batch_key(("m", i), ids, attention) for i in range(5)]
    for key in keys:
        cache.put(key, block.clone())
    assert cache.used == 2**20 and cache.get(keys[0]) is None  # the oldest left
    assert all(cache.get(k) is not None for k in keys[1:])
    cache.put(("too", "big"), torch.zeros(2**19))  # 2 MiB: never admitted
    assert cache.get(("too", "big")) is None and cache.used == 2**20
    # The same tokens with another attention mask, or other tokens, are other keys.
    assert batch_key(("m",), ids, torch.tensor([[1, 1, 0]])) != batch_key(("m",), ids, attention)
    assert batch_key(("m",), torch.tensor([[5, 6, 8]]), attention) != batch_key(
        ("m",), ids, attention
    )
    cache.resize(0)
    assert cache.used == 0 and cache.get(keys[4]) is None


def test_the_offline_tasks_of_a_run_replay_the_frozen_layers(prefect_harness, tmp_path):
    from lightning_rl.gpu_slot import ensure_gpu_limit
    from lightning_rl.tasks.training import train_offline

    ensure_gpu_limit()  # the task holds the Prefect server's GPU slot while it trains
    cfg = config()
    batch = recorded_batch(LoRATrainer(cfg))
    first = train_offline.fn(cfg, batch, None, str(tmp_path / "1"), OfflineConfig())
    # The next iteration continues the adapter on the same episodes: the bottom layer's
    # output on them is replayed from the first task's passes.
    second = train_offline.fn(cfg, batch, str(tmp_path / "1"), str(tmp_path / "2"), OfflineConfig())
    assert first["offline/filtered"] == second["offline/filtered"] == 0.0
    assert second["train/frozen_replayed_frac"] == 1.0
    off = train_offline.fn(
        cfg, batch, str(tmp_path / "2"), str(tmp_path / "3"), OfflineConfig(frozen_cache_mb=0)
    )
    assert "train/frozen_replayed_frac" not in off
