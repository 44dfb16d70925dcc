"""The LightningStore: the hub through which runners, agents and the trainer exchange data."""

from lightning_core.store.base import LightningStore
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.config import StoreConfig
from lightning_core.store.duckdb_store import DuckDBStore

__all__ = ["DuckDBStore", "HttpStoreClient", "LightningStore", "StoreConfig"]
