"""Content hashes of what answers a call: an adapter folder's bytes, and the tokenizer and chat
template that render prompts (data/provenance.py says how a run checks them).

A policy version's name says which adapter a run meant to serve; it does not say which weights
answered. The gateway hashes the adapter files it actually loads and fingerprints the tokenizer
it actually renders with, and every call's span carries both.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lightning_core.security.adapter_folder import CONFIG_FILE, WEIGHTS_FILE

# The files PEFT loads from an adapter folder: only they decide what the adapter computes.
_HASHED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_CHUNK = 1 << 20


def adapter_hash(folder: str | Path) -> str:
    """sha256 (hex) of an adapter folder's config and weights, each with its name and length,
    so that moving bytes between the files changes it too. Read in chunks: the weights can be
    hundreds of MB."""
    digest = hashlib.sha256()
    for name in _HASHED_FILES:
        path = Path(folder) / name
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def template_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of what turns messages into token ids: the chat template, the vocabulary
    (token -> id) and the special tokens. Two tokenizers with the same fingerprint render and
    encode every conversation alike."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = sorted(get_vocab().items(), key=lambda item: item[1]) if get_vocab else None
    facts = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "vocab": vocab,
        "special_tokens": getattr(tokenizer, "special_tokens_map", {}),
    }
    canonical = json.dumps(facts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
