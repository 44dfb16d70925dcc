"""Concurrent rollouts and training (TrainConfig.staleness > 0).

With staleness 0 an iteration's subflow samples its rollouts on the policy the previous one
published, then trains: rollouts and training take turns. With staleness s > 0 a producer
thread samples the rollouts of iteration j as soon as the newest published policy is at most
s versions behind the policy iteration j will train, each batch on that newest policy, while
the iteration subflows train on the batches in order. So iteration k+1's rollouts run while
iteration k's update trains; the producer waits only at the bound, and an iteration waits only
for a batch that is not collected yet.

    producer:  rollouts-1 (v0) | rollouts-2 (v0)   | rollouts-3 (v1)   | ...
    trainer:                   | iteration-1 -> v1 | iteration-2 -> v2 | ...

Iteration k then trains policy v(k-1) on rollouts of v(k-1-s) or newer; the loss corrects for
the lag (truncated importance sampling, losses.py) and each iteration logs the lag it saw
(`train/staleness_*`) and how long each side waited (`pipeline/*_wait_s`).

Each batch runs as its own subflow run, `rollouts-<j>`, from the producer's thread with the
flow run's context, so it shows in the Prefect UI beside the iteration subflows. A batch is
handed to its iteration in this process (a Python object, never a flow parameter: parameters
are stored and shown, and a batch is thousands of token ids). A run that stops loses the
batches not yet trained; a resumed run cancels their unfinished rollouts and samples anew.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from lightning_core.data.collect import Collected

# The run's pipeline while it runs: the iteration subflows run in the flow's thread and context,
# and find it here (a producer is no flow parameter: those are stored and shown).
_AHEAD: contextvars.ContextVar[RolloutsAhead | None] = contextvars.ContextVar(
    "lightning_rolloutsahead", default=None
)


@dataclass
class Batch:
    """An iteration's rollouts, collected: what the iteration subflow trains on."""

    collected: Collected
    sampled: dict[str, float]
    # The curriculum's learnability after this batch's groups were observed (the checkpoint's).
    learnability: dict[str, float]
    policy: str
    started: float
    ended: float


@dataclass
class _Slot:
    done: threading.Event = field(default_factory=threading.Event)
    batch: Batch | None = None
    error: BaseException | None = None


Collect = Callable[[int, str], Batch]


class RolloutsAhead:
    """The producer thread of one run: batches for iterations first..last, each sampled on the
    newest published policy once it is at most `staleness` versions behind."""

    def __init__(
        self,
        run_name: str,
        collect: Collect,
        first: int,
        last: int,
        policy: str,
        staleness: int,
    ) -> None:
        self.run_name = run_name
        self._collect = collect
        self._first, self._last = first, last
        self._staleness = staleness
        self._published = (first - 1, policy)
        self._slots = {j: _Slot() for j in range(first, last + 1)}
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self.producer_wait_s = 0.0
        # The flow run's context travels with the thread, so its subflows nest under it.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._produce,), name=f"rollouts-ahead-{run_name}"
        )
        self._thread.daemon = True
        self._entered: contextvars.Token[RolloutsAhead | None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> RolloutsAhead:
        self._entered = _AHEAD.set(self)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        if self._entered is not None:
            _AHEAD.reset(self._entered)
            self._entered = None
        # A batch being sampled ends with its rollouts (the server goes down with the run).
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the producer

    def _produce(self) -> None:
        for j in range(self._first, self._last + 1):
            slot = self._slots[j]
            try:
                policy = self._wait_for_policy(j)
                if policy is None:
                    return
                slot.batch = self._collect(j, policy)
            except BaseException as exc:  # handed to the iteration that waits for it
                slot.error = exc
                for later in range(j + 1, self._last + 1):
                    self._slots[later].error = exc
                    self._slots[later].done.set()
                return
            finally:
                slot.done.set()

    def _wait_for_policy(self, j: int) -> str | None:
        """The newest published policy once it is at least version j - 1 - staleness (the
        staleness bound); None when the run stops first."""
        waited = time.monotonic()
        with self._changed:
            while self._published[0] < j - 1 - self._staleness:
                if self._stopping.is_set():
                    return None
                self._changed.wait()
            self.producer_wait_s += time.monotonic() - waited
            return None if self._stopping.is_set() else self._published[1]

    # ------------------------------------------------------------------ the trainer's side

    def take(self, iteration: int) -> tuple[Batch, float]:
        """Iteration k's batch once it is collected, and the seconds spent waiting for it."""
        slot = self._slots[iteration]
        waited = time.monotonic()
        slot.done.wait()
        if slot.error is not None:
            raise slot.error
        batch, slot.batch = slot.batch, None  # taken once: the pipeline keeps no old batches
        if batch is None:
            raise RuntimeError(f"the rollouts of iteration {iteration} were taken already")
        return batch, time.monotonic() - waited

    def published(self, iteration: int, policy: str) -> None:
        """Iteration k's policy is published: batches the bound held back may start."""
        with self._changed:
            self._published = (iteration, policy)
            self._changed.notify_all()


def running() -> RolloutsAhead | None:
    """The pipeline of the run this thread works for; None with staleness 0 (or none running)."""
    return _AHEAD.get()


class PolicyRef(BaseModel, frozen=True):
    """A policy version a run publishes: iteration k's adapter is `<run>-v<k>` (k = 0: the
    champion a warm start begins from), an agent's own adapter `<run>-v<k>-<agent>`."""

    run: str
    index: int

    def name(self, agent: str | None = None) -> str:
        return f"{self.run}-v{self.index}" + (f"-{agent}" if agent else "")


def staleness_metrics(
    collected: Collected, trained: int, run_name: str, agents: list[str] | None = None
) -> dict[str, Any]:
    """How many versions behind policy v`trained` (the one the update starts from) the
    iteration's calls were sampled: `train/staleness_mean` and `_max` (none without calls).
    A call served by the base model, or by anything but this run's versions, counts as v0."""
    index = {
        PolicyRef(run=run_name, index=k).name(agent): k
        for k in range(trained + 1)
        for agent in [None, *(agents or [])]
    }
    lags = [trained - index.get(t.policy_version or "", 0) for t in collected.transitions]
    if not lags:
        return {}
    return {
        "train/staleness_mean": sum(lags) / len(lags),
        "train/staleness_max": float(max(lags)),
    }
