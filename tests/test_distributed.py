"""Data-parallel LoRA updates (torch.distributed, gloo on CPU): two processes give the update
one process gives, saved in the same form; and a flow iteration trains that way."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.distributed import train_data_parallel
from lightning_core.algo.trainer import STATE_FILE, LoRATrainer
from lightning_core.errors import InvalidInput
from lightning_core.models import tiny_model_dir
from lightning_core.types import Transition

# Each test launches torchrun (processes that load torch and the model): ~20 s apiece on CPU.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WEIGHTS = "adapter_model.safetensors"


def config(**overrides) -> TrainerConfig:
    # micro_batch_tokens small: each process's share is itself cut into micro-batches.
    return TrainerConfig(
        model=str(tiny_model_dir()), learning_rate=1e-3, micro_batch_tokens=32, **overrides
    )


def batch(n: int = 7) -> list[Transition]:
    """Transitions of mixed lengths and advantages whose behaviour logprobs are the initial
    policy's own: every ratio starts at 1, so the first update has a real, unclipped gradient."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        prompt = torch.randint(
            3, 1000, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g
        )
        response = torch.randint(
            3, 1000, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g
        )
        out.append(
            Transition(
                rollout_id=f"ro-{i}",
                step=0,
                prompt_token_ids=prompt.tolist(),
                response_token_ids=response.tolist(),
                advantage=(1.0, -0.5, 2.0)[i % 3],
            )
        )
    logprobs = LoRATrainer(config()).response_logprobs(out)
    return [
        t.model_copy(update={"response_logprobs": lp}) for t, lp in zip(out, logprobs, strict=True)
    ]


def max_diff(a: Path, b: Path) -> float:
    x, y = load_file(a / WEIGHTS), load_file(b / WEIGHTS)
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.fixture(scope="module")
def updated(tmp_path_factory):
    """Two updates from a new adapter, on two processes and on one: their saved folders and
    metrics."""
    root = tmp_path_factory.mktemp("dp")
    transitions = batch()
    updates = [transitions[0::2], transitions[1::2]]
    started = time.perf_counter()
    parallel = train_data_parallel(config(data_parallel=2), updates, None, root / "parallel")
    print(f"2-process update: {time.perf_counter() - started:.1f} s")
    single = LoRATrainer(config())
    init = single.save(root / "init")
    expected = [single.step(u) for u in updates]
    single.save(root / "single")
    return root, parallel, expected, init


def test_two_gloo_processes_give_the_single_process_update(updated):
    root, parallel, expected, init = updated
    # The update moved the adapter well past the tolerance, and both moved it alike.
    assert max_diff(root / "single", init) > 1e-3
    assert max_diff(root / "parallel", root / "single") < 1e-5
    assert len(parallel) == len(expected) == 2
    for got, want in zip(parallel, expected, strict=True):
        assert set(got) == set(want)
        assert want["train/grad_norm"] > 0
        for key in ("train/loss", "train/kl", "train/clip_frac", "train/entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-4)


def test_the_saved_folder_is_a_single_process_one_and_resumes_alike(updated):
    root, *_ = updated
    files = {p.name for p in (root / "parallel").iterdir()}
    assert files == {p.name for p in (root / "single").iterdir()}
    assert {WEIGHTS, "adapter_config.json", STATE_FILE} <= files
    state = torch.load(root / "parallel" / STATE_FILE, weights_only=False)
    assert state["version"] == 2 and state["optimizer"]["state"]

    # The next update from either folder is the same: optimizer moments were saved alike.
    following = batch()[:4]
    after = []
    for name in ("parallel", "single"):
        trainer = LoRATrainer(config(), adapter=root / name)
        assert trainer.version == 2
        trainer.step(following)
        after.append(trainer.save(root / f"{name}-next"))
    assert max_diff(*after) < 1e-5


def test_more_processes_than_transitions_and_clear_errors(tmp_path):
    # Three processes, one transition: two have no share and add zero gradient.
    one = batch()[:1]
    train_data_parallel(config(data_parallel=3), [one], None, tmp_path / "parallel")
    single = LoRATrainer(config())
    single.step(one)
    single.save(tmp_path / "single")
    assert max_diff(tmp_path / "parallel", tmp_path / "single") < 1e-5

    # A process's error reaches the caller as it is, and nothing is written.
    unscored = [one[0].model_copy(update={"advantage": None})]
    with pytest.raises(InvalidInput, match="advantage"):
        train_data_parallel(config(data_parallel=2), [unscored], None, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_flow_iteration_trains_on_two_processes(prefect_test_server, tmp_path):
    from lightning_rl.flows.train import train
    from lightning_rl.registry.config import RegistryConfig
    from tests.conftest import use_prefect_server

    with use_prefect_server(prefect_test_server):
        state = train(
            agent="tests.flow_agents:agent",
            tasks="tests.flow_agents:load_tasks",
            iterations=1,
            trainer={"data_parallel": 2},
            run_dir=str(tmp_path / "runs"),
            run_name="dp",
            registry=RegistryConfig(
                tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", registered_model="dp-test"
            ),
            return_state=True,
            server={"model": "tiny"},
            rollouts={
                "tasks_per_iteration": 2,
                "group_size": 4,
                "sampling": {"temperature": 1.0},
                "rollout_workers": 1,
                "rollout_concurrency": 2,
            },
            evaluation={"eval_size": 2},
        )
        assert state.is_completed(), state.message
    from lightning_rl.tasks.training import _live

    # The update ran in the processes: no in-process trainer of this config was kept live.
    assert not [key for key in _live if '"data_parallel":2' in key[1]]
    adapters = sorted((tmp_path / "runs" / "dp").rglob(WEIGHTS))
    assert adapters, "the iteration saved no adapter"
    # A new LoRA adapter starts with B = 0: any non-zero B is the update's doing.
    weights = load_file(adapters[-1])
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in weights.items())
