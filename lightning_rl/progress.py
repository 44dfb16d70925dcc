"""Progress of a training run as JSON lines in its folder, for live displays to follow.

The flow may run anywhere (a Prefect worker, a thread of the CLI); a file is the one channel
every display can read without a server: `lightning-rl train` tails it into a live view.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

PROGRESS_FILE = "progress.jsonl"
_lock = threading.Lock()


def report(run_dir: str | Path, stage: str, /, **fields: Any) -> None:
    """Append one event: a stage name and whatever numbers describe where it is."""
    line = json.dumps({"time": time.time(), "stage": stage, **fields}, default=str)
    with _lock, open(Path(run_dir) / PROGRESS_FILE, "a") as out:
        out.write(line + "\n")


def read(run_dir: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Events written since byte `offset`, and the offset to read from next time."""
    path = Path(run_dir) / PROGRESS_FILE
    if not path.exists():
        return [], offset
    with open(path) as source:
        source.seek(offset)
        text = source.read()
    complete = text[: text.rfind("\n") + 1]  # a line being written waits for the next read
    events = [json.loads(line) for line in complete.splitlines() if line.strip()]
    return events, offset + len(complete.encode())
