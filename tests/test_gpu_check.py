"""The GPU readiness check's CPU dry run (as CI runs it) and the `--preset` layer of `train`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_core.errors import LightningError
from lightning_rl.flows.cli.options import train_fields
from lightning_rl.flows.config import TrainConfig
from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (decode|train) \| ([^|]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|")


def test_the_dry_run_prints_decode_at_1_8_64_and_a_train_step_with_positive_figures():
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [m.groups() for line in done.stdout.splitlines() if (m := ROW.match(line))]
    decode = {shape.strip(): row for phase, shape, *row in rows if phase == "decode"}
    assert set(decode) == {"1 concurrent", "8 concurrent", "64 concurrent"}
    train = [row for phase, _, *row in rows if phase == "train"]
    assert len(train) == 1
    for tokens, seconds, per_s, tflops in [*decode.values(), *train]:
        assert int(tokens) > 0 and float(seconds) > 0 and float(per_s) > 0 and float(tflops) > 0
    # 64 requests of 8 new tokens: all of them generated (a random model rarely samples eos).
    assert int(decode["64 concurrent"][0]) > 8 * int(decode["8 concurrent"][0]) // 2
    figures = dict(re.findall(r"^(gpu_check_\w+): ([\d.]+)$", done.stdout, re.M))
    for name in ("decode_tokens_per_s_64", "decode_mfu_1", "train_tokens_per_s", "train_mfu"):
        assert float(figures[f"gpu_check_{name}"]) > 0, name


def test_the_shipped_config_has_qwen2_5_1_5bs_shape():
    config = json.loads((REPO / "benchmarks/configs/qwen2.5-1.5b.json").read_text())
    assert config["model_type"] == "qwen2"
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert [config[k] for k in shape] == [1536, 28, 12, 2]
    assert (config["intermediate_size"], config["vocab_size"]) == (8960, 151936)
    assert config["tie_word_embeddings"] is True


def _settings(preset: str | None, **flags) -> TrainConfig:
    options = {name: None for name in TrainConfig.model_fields} | flags | {"preset": preset}
    return TrainConfig.model_validate(train_fields(options, None, None))


def test_preset_gpu_resolves_to_the_large_model_on_vllm_in_bf16():
    gpu = _settings("gpu")
    assert gpu.server.model == "Qwen/Qwen2.5-1.5B-Instruct" and gpu.server.backend == "vllm"
    assert gpu.trainer.dtype == "bfloat16" and gpu.trainer.lora.top_layers is None
    cpu = TrainConfig()
    assert gpu.rollouts.tasks_per_iteration > cpu.rollouts.tasks_per_iteration
    assert gpu.rollouts.group_size > cpu.rollouts.group_size
    assert gpu.rollouts.rollout_concurrency > cpu.rollouts.rollout_concurrency
    assert gpu.trainer.micro_batch_tokens > cpu.trainer.micro_batch_tokens
    # The demo trainer's other settings stay (nested settings merge key by key).
    assert gpu.trainer.learning_rate == cpu.trainer.learning_rate


def test_preset_cpu_is_the_defaults_and_no_preset_changes_nothing():
    assert _settings("cpu") == TrainConfig() == _settings(None)


def test_config_file_and_flags_win_over_the_preset(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"group_size": 2, "trainer": {"micro_batch_tokens": 1024}}))
    options = {"preset": "gpu", "model": "my/model"}
    settings = TrainConfig.model_validate(train_fields(options, config, None))
    assert settings.server.model == "my/model" and settings.rollouts.group_size == 2
    assert settings.trainer.micro_batch_tokens == 1024 and settings.trainer.dtype == "bfloat16"
    assert settings.server.backend == "vllm"


def test_an_unknown_preset_is_a_one_line_error():
    with pytest.raises(LightningError, match=r"^unknown preset 'tpu'; choose one of: cpu, gpu$"):
        _settings("tpu")


def test_the_train_command_reports_an_unknown_preset_without_a_traceback():
    done = run_cli("train", "--preset", "tpu")
    assert done.returncode != 0
    assert "unknown preset 'tpu'" in done.stderr and "Traceback" not in done.stderr
