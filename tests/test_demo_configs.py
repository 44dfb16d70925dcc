"""The shipped run configs (`make demo-sql`, `make demo-rag`, the SQL ablation) are valid
TrainConfigs for a known agent profile: a typo would otherwise surface only when a user starts
a run of up to an hour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_rl.flows.config import SECTIONS, TrainConfig
from lightning_rl.flows.profiles import profile

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [
    *sorted((ROOT / "flows" / "demos").glob("*.json")),
    ROOT / "benchmarks" / "ablation_sql.json",
]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_a_valid_train_config(path: Path) -> None:
    fields = json.loads(path.read_text())
    # Written in their sections, as this release's configs are (no flat names of earlier ones).
    unknown = set(fields) - set(TrainConfig.model_fields)
    flat = {
        name for name, value in fields.items() if name in SECTIONS and not isinstance(value, dict)
    }
    assert not flat, f"{path.name}: flat names {flat}"
    assert not unknown, f"{path.name}: unknown fields {unknown}"
    config = TrainConfig.model_validate(fields)
    assert profile(config.agent, config.tasks).name == fields["agent"]
    # The comparison of base and final is per tier: the curriculum's key must name the tier.
    assert config.curriculum.tier_key == "tier"


def test_the_demo_configs_named_in_the_makefile_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for name in (
        "flows/demos/sql.json",
        "flows/demos/sql_sft.json",
        "flows/demos/rag.json",
        "benchmarks/ablation_sql.json",
    ):
        assert name in makefile
        assert (ROOT / name).is_file()
