"""A LoRA adapter folder named from outside (a published policy version, a downloaded champion),
checked before anything reads it.

Whoever can publish a policy version or register a model chooses the folder, so the folder
must not be able to do more than hold an adapter:
- it lies under an allowed root, resolved with its links followed: a link that leads out of
  the roots is refused, wherever it sits in the folder;
- it is a local folder: a hub-style id ("org/name") never reaches PEFT, which would try the
  Hub (23 s of retries measured, every generation waiting behind it);
- its weights are safetensors (`adapter_model.safetensors`), never a pickle (`.bin`);
- its config is a plain LoRA: `r` within a cap, `target_modules` a short list of module
  names (PEFT reads a string as a regular expression and matches it against every module,
  and a huge `r` costs seconds and hundreds of MB), and no option that copies or rebuilds
  the base model's weights (`modules_to_save`, `layer_replication`, PiSSA-style inits).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from lightning_core.errors import InvalidInput

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
# A module name as PEFT matches it (a suffix of the module's dotted path): no pattern syntax.
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
# An adapter config is a few KB; anything near this is not one.
_MAX_CONFIG_BYTES = 1 << 20
# Entries walked looking for links out of the roots: an adapter folder holds a handful.
_MAX_ENTRIES = 1000
# Inits that decompose the base weights when the adapter is built (seconds per layer on CPU);
# the weights are loaded over them anyway.
_CHEAP_INITS = (True, False, "gaussian")
# Options whose non-empty value makes the adapter copy or rebuild parts of the base model.
_MUST_BE_EMPTY = ("modules_to_save", "layer_replication", "trainable_token_indices")


class AdapterRules(BaseModel):
    """Where LoRA adapters from outside may be loaded from, and what they may ask of the server
    that loads them. The gateway's config inherits these fields (LIGHTNING_<NAME> in `serve`)."""

    adapter_roots: list[str] = Field(
        default_factory=list,
        description="Folders whose adapters a published policy version may load, as a JSON "
        "list (LIGHTNING_ADAPTER_ROOTS='[\"/data/adapters\"]'); `lightning-rl serve` adds its "
        "store's folder, which holds a run's adapters and the champion it downloads.",
    )
    max_adapter_rank: int = Field(
        64, ge=1, description="Largest LoRA rank `r` of an adapter (the trainer's default is 8)."
    )
    max_adapter_target_modules: int = Field(
        16,
        ge=1,
        description="Most module names in an adapter's target_modules (a Llama has 7 kinds of "
        "linear layer).",
    )
    max_adapter_bytes: int = Field(
        2 << 30,
        ge=1,
        description="Largest adapter_model.safetensors, which is read whole when loaded.",
    )


def allowed_folder(path: str | os.PathLike[str], roots: Sequence[str | Path]) -> Path:
    """`path` resolved, when it is an existing local folder under one of `roots` (resolved too)
    with no link inside leading out of them; InvalidInput naming the problem otherwise."""
    given = Path(path).expanduser()
    if not given.is_absolute():
        raise InvalidInput(
            f"adapter_path {str(path)!r} is not an absolute path: adapters are loaded from local "
            "folders only, never from the Hub; give the folder's absolute path"
        )
    resolved_roots = [Path(r).expanduser().resolve() for r in roots]
    if not resolved_roots:
        raise InvalidInput(
            f"no adapter folder is allowed on this server, so {given} cannot be loaded; add its "
            "parent folder to LIGHTNING_ADAPTER_ROOTS (a JSON list of folders)"
        )
    folder = given.resolve()
    if not _inside(folder, resolved_roots):
        raise InvalidInput(
            f"adapter_path {given} (resolved: {folder}) is outside the folders adapters may be "
            f"loaded from ({', '.join(map(str, resolved_roots))}); move it there or add its "
            "parent folder to LIGHTNING_ADAPTER_ROOTS"
        )
    if not folder.is_dir():
        raise InvalidInput(f"adapter_path {given} is not a PEFT adapter folder: no such folder")
    for link in _links(folder):
        target = link.resolve()
        if not _inside(target, resolved_roots):
            raise InvalidInput(
                f"{link} in the adapter folder is a link to {target}, outside the folders "
                "adapters may be loaded from; copy the file in instead of linking it"
            )
    return folder


def adapter_config(folder: Path, rules: AdapterRules | None = None) -> dict[str, Any]:
    """The adapter config of a local adapter folder, once its files and config pass `rules`
    (all but the roots)."""
    rules = rules or AdapterRules()
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise InvalidInput(
            f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder; save one with "
            "save_pretrained"
        )
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        found = " (it has adapter_model.bin, a pickle, which is never loaded)"
        raise InvalidInput(
            f"{folder} has no {WEIGHTS_FILE}"
            f"{found if (folder / PICKLE_WEIGHTS_FILE).exists() else ''}; save the adapter "
            "with save_pretrained(safe_serialization=True)"
        )
    if weights.stat().st_size > rules.max_adapter_bytes:
        raise InvalidInput(
            f"{weights} is {weights.stat().st_size} bytes, above the limit of "
            f"{rules.max_adapter_bytes} (LIGHTNING_MAX_ADAPTER_BYTES)"
        )
    if config_file.stat().st_size > _MAX_CONFIG_BYTES:
        raise InvalidInput(f"{config_file} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidInput(f"{config_file} holds a {type(config).__name__}, not an object")
    check_lora_config(config, rules, where=str(config_file))
    return config


def check_lora_config(config: dict[str, Any], rules: AdapterRules, where: str) -> None:
    """InvalidInput unless `config` (an adapter_config.json's content) is a plain LoRA within
    `rules`."""
    if config.get("peft_type") != "LORA":
        raise InvalidInput(f"{where}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    rank_pattern = config.get("rank_pattern") or {}
    ranks = {"r": config.get("r")}
    if isinstance(rank_pattern, dict):
        ranks |= {f"rank_pattern[{k!r}]": v for k, v in rank_pattern.items()}
    for name, rank in ranks.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise InvalidInput(f"{where}: {name} must be a positive integer, not {rank!r}")
        if rank > rules.max_adapter_rank:
            raise InvalidInput(
                f"{where}: {name} is {rank}, above the largest LoRA rank allowed "
                f"({rules.max_adapter_rank}; LIGHTNING_MAX_ADAPTER_RANK)"
            )
    targets = config.get("target_modules")
    _names(where, "target_modules", targets, required=True)
    if len(targets) > rules.max_adapter_target_modules:
        raise InvalidInput(
            f"{where}: target_modules lists {len(targets)} modules, more than the "
            f"{rules.max_adapter_target_modules} allowed (LIGHTNING_MAX_ADAPTER_TARGET_MODULES)"
        )
    layers_pattern = config.get("layers_pattern")
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]
    _names(where, "layers_pattern", layers_pattern)
    for key in ("exclude_modules", "target_parameters"):
        _names(where, key, config.get(key))
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            raise InvalidInput(f"{where}: {key} must be an object of module names")
        _names(where, key, list(pattern))
    for key in _MUST_BE_EMPTY:
        if config.get(key):
            raise InvalidInput(
                f"{where}: {key} is set ({config[key]!r}); served adapters hold LoRA weights only"
            )
    init = config.get("init_lora_weights", True)
    if init not in _CHEAP_INITS:
        raise InvalidInput(
            f"{where}: init_lora_weights {init!r} decomposes the base weights when loading; "
            "save the adapter with init_lora_weights true (the weights are loaded over it)"
        )


def _names(where: str, key: str, value: Any, required: bool = False) -> None:
    """InvalidInput unless `value` is a list of plain module names (or absent, if allowed)."""
    if value is None and not required:
        return
    if not isinstance(value, list) or (required and not value):
        raise InvalidInput(
            f'{where}: {key} must be a list of module names (e.g. ["q_proj", "v_proj"]), '
            f"not {value!r:.80}: a string is read as a pattern, which is not accepted"
        )
    for name in value:
        if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name):
            raise InvalidInput(
                f"{where}: {key} holds {name!r:.80}, which is not a plain module name "
                "(letters, digits, '_' and '.')"
            )


def check_adapter(path: str | os.PathLike[str], rules: AdapterRules) -> Path:
    """The resolved folder of the adapter at `path`, once it passes every rule above."""
    try:
        folder = allowed_folder(path, rules.adapter_roots)
        adapter_config(folder, rules)
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, no permission
        raise InvalidInput(f"cannot read the adapter folder {str(path)[:300]!r}: {exc}") from exc
    return folder


def missing_modules(targets: Iterable[str], module_names: Iterable[str]) -> list[str]:
    """The names in `targets` that no module of a model (its dotted `module_names`) ends with,
    as PEFT matches a list of target modules."""
    suffixes: set[str] = set()
    for name in module_names:
        parts = name.split(".")
        suffixes.update(".".join(parts[i:]) for i in range(len(parts)))
    return [t for t in targets if t not in suffixes]


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def _links(folder: Path) -> list[Path]:
    """The links inside `folder` (not followed), however deep."""
    links: list[Path] = []
    seen = 0
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            seen += 1
            if seen > _MAX_ENTRIES:
                raise InvalidInput(
                    f"{folder} holds more than {_MAX_ENTRIES} entries: not an adapter folder"
                )
            entry = Path(top) / name
            if entry.is_symlink():
                links.append(entry)
    return links
