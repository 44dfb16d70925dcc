"""The LightningStore: the hub through which runners, agents and the trainer exchange data.

Names are imported on first use, so that the database worker process, which imports this
package, does not pay for the HTTP client and server it never uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_core.store.base import LightningStore
    from lightning_core.store.client import HttpStoreClient
    from lightning_core.store.config import StoreConfig
    from lightning_core.store.duckdb_store import DuckDBStore

_WHERE = {
    "DuckDBStore": "lightning_core.store.duckdb_store",
    "HttpStoreClient": "lightning_core.store.client",
    "LightningStore": "lightning_core.store.base",
    "StoreConfig": "lightning_core.store.config",
}

__all__ = ["DuckDBStore", "HttpStoreClient", "LightningStore", "StoreConfig"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'lightning_core.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
