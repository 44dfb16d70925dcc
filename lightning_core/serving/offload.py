"""Request-sized CPU work off the event loop, on a small bounded pool of worker threads.

Rendering a chat template, tokenizing a prompt, checking and compiling a grammar take time in
proportion to what a client sent: on the event loop, a 2.6 MB prompt stalled every route of the
server, /health included, for 2.4-3.5 s. Here they run on at most `WORKERS` threads, so a flood
of big requests queues up behind them instead of taking every core. Tokenizers (Rust) and
llguidance drop the GIL while they work, so the loop keeps answering meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Enough to overlap a few big requests; more would take cores from the engine's decode steps.
WORKERS = max(2, min(4, os.cpu_count() or 2))

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="lightning-cpu")
        return _pool


async def off_loop(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)` on a worker thread; its result or its exception."""
    call = functools.partial(function, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)
