"""The live view of `lightning-rl train` in a terminal: where the run is, the iterations so
far and the held-out scores, followed from the run folder's progress.jsonl."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

# Stages that count finished rollouts toward a total, and how the view names them.
COUNTED = {
    "rollout": "rollouts",
    "eval": "evaluation",
    "calibration": "judge calibration",
    "sft": "warm-start samples",
}


class LiveView:
    """Follows a run folder's progress.jsonl and renders where the run is."""

    def __init__(self, run_dir: Path, iterations: int) -> None:
        self.run_dir = run_dir
        self.iterations = iterations
        self.offset = 0
        self.stage = "starting (model load, policy server)"
        self.iteration = 0
        self.done = 0
        self.total = 0
        self.evals: list[tuple[int, float, float, float]] = []
        self.rows: list[dict[str, Any]] = []
        self.started = time.time()

    def update(self) -> None:
        from lightning_rl import progress

        events, self.offset = progress.read(self.run_dir, self.offset)
        for e in events:
            stage = e["stage"]
            if stage in COUNTED:
                if stage != self.stage:
                    self.stage, self.done = stage, 0
                self.done += 1
                self.total = e.get("total", self.total)
            elif stage == "iteration":
                self.iteration, self.stage, self.done = e["iteration"], "planning", 0
            elif stage == "training":
                self.stage = f"training on {e['transitions']} transitions"
            elif stage == "evaluated":
                self.evals.append((e["iteration"], e["score"], e["ci_low"], e["ci_high"]))
                self.stage = "evaluated"
            elif stage == "iterated":
                self.rows.append(e)
            elif stage == "done":
                self.stage = "done"

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        minutes = (time.time() - self.started) / 60
        where = self.stage
        if self.stage in COUNTED and self.total:
            where = f"{COUNTED[self.stage]} {self.done}/{self.total}"
        head = Text(
            f"iteration {self.iteration}/{self.iterations} | {where} | {minutes:.1f} min",
            style="bold",
        )
        table = Table(box=None, pad_edge=False)
        for column in ("iter", "reward", "success", "actions/ep", "trained", "policy"):
            table.add_column(column)
        for r in self.rows[-8:]:
            table.add_row(
                str(r["iteration"]),
                f"{r.get('rollout/reward_mean', float('nan')):.3f}",
                f"{r.get('rollout/success_rate', float('nan')):.3f}",
                f"{r.get('rollout/actions_per_episode', float('nan')):.2f}",
                f"{int(r.get('train/transitions', 0))}",
                str(r.get("policy", "")),
            )
        evals = Text(
            "held-out: "
            + (
                ", ".join(f"it{i} {a:.1%} [{lo:.1%}, {hi:.1%}]" for i, a, lo, hi in self.evals)
                or "pending"
            )
        )
        return Group(head, evals, table)


def run_with_view(fn: Any, run_dir: Path, iterations: int) -> Any:
    """Run `fn` (a flow call) here, with the live view refreshed from another thread."""
    from rich.live import Live

    view = LiveView(run_dir, iterations)
    stop = threading.Event()
    with Live(view.render(), refresh_per_second=2, transient=False) as live:

        def follow() -> None:
            while not stop.wait(0.5):
                view.update()
                live.update(view.render())

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        try:
            return fn()
        finally:
            stop.set()
            thread.join(timeout=2)
            view.update()
            live.update(view.render())
