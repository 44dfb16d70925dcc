"""OpenMP's wait policy, chosen before torch loads: passive where rollouts overlap training
on a CPU (staleness > 0 on the transformers backend)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_core.errors import LightningError


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
    """`staleness` and `backend` as the run will have them, from the layers `train` reads
    (flows/cli/options.py config_layers), without importing torch: by their flat names or in
    their sections. Layers that cannot be read count as empty: the command itself reports it."""
    from lightning_rl.flows.cli.options import config_layers

    wanted = ("staleness", "backend", "run_dir", "run_name")
    given = {k.replace("-", "_"): v for k, v in flags.items() if k.replace("-", "_") in wanted}
    try:
        layers = config_layers(
            given,
            Path(flags["config"]) if flags.get("config") else None,
            flags.get("resume") or None,
            flags.get("preset") or None,
            strict=False,
        )
    except (LightningError, OSError, ValueError):
        return {}
    fields: dict[str, Any] = {}
    for layer in layers:  # a later layer wins, whether it writes a name flat or in a section
        for name, section in (("staleness", "rollouts"), ("backend", "server")):
            inner = layer.get(section)
            if isinstance(inner, dict) and name in inner:
                fields[name] = inner[name]
            elif name in layer:
                fields[name] = layer[name]
    return fields
