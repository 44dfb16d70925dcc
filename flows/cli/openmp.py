"""OpenMP's wait policy, chosen before torch loads: passive where rollouts overlap training
on a CPU (staleness > 0 on the transformers backend)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def passive_openmp(argv: list[str]) -> None:
    """`lightning-rl train` with a staleness above 0 on the transformers backend: OpenMP threads
    wait passively in this process (the trainer's) and, by inheritance, in the policy server's
    (flows/run_start.py server_env). Spinning, each process's threads burn the cores the other
    needs while rollouts and training overlap on a CPU. OpenMP reads the setting once, when
    torch loads, so it is set here, before anything imports torch, from the flags, the --config
    file, the resumed run's config and the preset, in the order `train_fields`
    (flows/cli/options.py) layers them.
    Measured in BENCHMARKS.md (issue 15): 3 calc iterations in 278 s passive on both sides,
    292 s without overlap."""
    if argv[:1] != ["train"] or "OMP_WAIT_POLICY" in os.environ:
        return
    flags: dict[str, str] = {}
    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name.startswith("--"):
            flags[name[2:]] = value if sep else (argv[i + 1] if i + 1 < len(argv) else "")
    fields = _overlap_fields(flags)
    if str(fields.get("staleness", 0)) not in ("", "0") and fields.get("backend") != "vllm":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _overlap_fields(flags: dict[str, str]) -> dict[str, Any]:
    """`staleness` and `backend` as the run will have them, read without importing torch. A
    layer that cannot be read counts as empty: the command itself reports it."""
    from lightning_rl.flows.presets import PRESETS
    from lightning_rl.flows.run_state import CONFIG_FILE, DEFAULT_RUN_DIR, run_path

    def read(path: str | Path) -> dict[str, Any]:
        try:
            value = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    from_file = read(flags["config"]) if flags.get("config") else {}
    layers = [PRESETS.get(flags.get("preset", ""), {})]
    if flags.get("resume"):
        run_dir = flags.get("run-dir") or from_file.get("run_dir") or DEFAULT_RUN_DIR
        layers.append(read(run_path(run_dir, flags["resume"]) / CONFIG_FILE))
    layers += [from_file, {k: v for k, v in flags.items() if k in ("staleness", "backend")}]
    fields: dict[str, Any] = {}
    for layer in layers:
        fields |= {k: layer[k] for k in ("staleness", "backend") if k in layer}
    return fields
