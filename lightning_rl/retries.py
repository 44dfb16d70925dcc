"""Which failed Prefect task runs are worth another try: a retry condition that fails at once
on errors the next try would meet again (a full disk, a spent budget)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def retry_unless(*errors: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A `retry_condition_fn` that retries every failure but one of `errors`."""

    def worth_retrying(task: Any, run: Any, state: Any) -> bool:
        try:
            state.result()
        except errors:
            return False
        except Exception:
            return True
        return True

    return worth_retrying
