"""The `gpu` global concurrency limit: training steps of concurrent runs take turns on the
accelerator, one slot each, and a run that died holding a slot never blocks the next one.

A slot is held on a Prefect lease that a thread renews while the step runs. A dead holder's
lease is freed by Prefect only where its server runs the repossessor, which a temporary server
does not (and a temporary server's leases in memory die with it: flows/prefect_server.py keeps
them in files under PREFECT_HOME instead). So a holder also leaves a record under PREFECT_HOME
naming its lease and its process, and before taking a slot a run releases the leases of holders
whose process is gone: a flow SIGKILLed in train-policy, then resumed, found its own slot taken
and waited forever (issue 25). A slot still taken after the wait's bound ends the run with which
limit it is and the command that frees it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import UUID

import psutil

from lightning_core.data.files import write_text_atomically
from lightning_core.errors import LightningError

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

log = logging.getLogger(__name__)

GPU_LIMIT = "gpu"
# Prefect's shortest lease (the API refuses less), renewed every third of it: a holder on
# another machine, which no record here names, stops holding a minute after it dies where the
# server runs the repossessor.
LEASE_S = 60.0
# How long a training step waits for a slot before it ends the run. Another run's step may hold
# it that long on purpose (a long update), hence the setting: LIGHTNING_GPU_SLOT_WAIT_S.
WAIT_S = 1800.0
WAIT_ENV = "LIGHTNING_GPU_SLOT_WAIT_S"
# Between tries for a taken slot: each try first releases what died meanwhile.
_RETRY_S = 2.0


class SlotUnavailable(LightningError):
    """A global concurrency slot stayed taken past the wait's bound."""

    status_code = 503


def ensure_gpu_limit(slots: int = 1) -> None:
    """Create the `gpu` global concurrency limit (one slot) unless it exists already, so that
    training steps of concurrent flow runs take turns on the accelerator. A team sizes it
    with `prefect gcl update gpu --limit N` (or creates it first); this leaves theirs alone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another run was first
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=slots)
                )


def wait_bound_s() -> float:
    """The wait's bound: LIGHTNING_GPU_SLOT_WAIT_S, else WAIT_S."""
    value = os.environ.get(WAIT_ENV)
    try:
        return float(value) if value else WAIT_S
    except ValueError:
        raise SlotUnavailable(f"{WAIT_ENV}={value!r} is no number of seconds") from None


def records_dir() -> Path:
    """Where holders of this machine record their leases: beside Prefect's own files."""
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / "lightning-slots"


def _started(pid: int) -> float | None:
    """When process `pid` started (None: no such process): a pid alone may be reused."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def release_dead_holders(client: SyncPrefectClient) -> int:
    """Release the leases whose recorded holder process is gone; returns how many."""
    released = 0
    folder = records_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            lease_id, pid, started = UUID(record["lease_id"]), record["pid"], record["started"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
        if record.get("host", socket.gethostname()) != socket.gethostname():
            continue  # another machine's, whose processes this one cannot see
        if _started(pid) == started:
            continue  # alive: its slot is in use
        # A lease the server no longer knows (expired and repossessed) is answered 204 too.
        client.release_concurrency_slots_with_lease(lease_id)
        path.unlink(missing_ok=True)
        log.warning(
            "released the %r slot that process %d held when it died (lease %s)",
            record.get("limit"),
            pid,
            lease_id,
        )
        released += 1
    return released


def _acquire(client: SyncPrefectClient, name: str, wait_s: float) -> UUID:
    """A lease on one slot of limit `name`, tried until `wait_s` has passed."""
    from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse
    from prefect.exceptions import PrefectHTTPStatusError

    deadline = time.monotonic() + wait_s
    while True:
        release_dead_holders(client)
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=LEASE_S
            )
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code != 423:  # 423 Locked: every slot is taken
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise _taken(client, name, wait_s) from None
            time.sleep(min(_RETRY_S, left))
            continue
        acquired = ConcurrencyLimitWithLeaseResponse.model_validate(response.json())
        if not acquired.limits:
            raise SlotUnavailable(
                f"the global concurrency limit {name!r} does not exist; create it with "
                f"`prefect gcl create {name} --limit 1`"
            )
        return acquired.lease_id


def _taken(client: SyncPrefectClient, name: str, wait_s: float) -> SlotUnavailable:
    limit = client.read_global_concurrency_limit_by_name(name)
    return SlotUnavailable(
        f"no slot of the global concurrency limit {name!r} came free in {wait_s:.0f} s "
        f"({limit.active_slots} of {limit.limit} taken). If no other run is training now, a run "
        f"on another machine or one started before this version died holding it: free it with "
        f"`prefect gcl update {name} --active-slots 0`, then resume this run. To wait longer "
        f"for a run that is training, set {WAIT_ENV}."
    )


def _renew(client: SyncPrefectClient, lease_id: UUID, stop: threading.Event) -> None:
    # The holder's client, not a new one: a thread starts without the flow's settings context,
    # where a new client would not know the flow's server.
    while not stop.wait(LEASE_S / 3):
        try:
            client.renew_concurrency_lease(lease_id=lease_id, lease_duration=LEASE_S)
        except Exception as exc:  # the next renewal may pass; the lease has time left
            log.warning("could not renew the slot lease %s: %s", lease_id, exc)


@contextlib.contextmanager
def gpu_slot(name: str = GPU_LIMIT, wait_s: float | None = None) -> Iterator[UUID]:
    """Hold one slot of limit `name` (the `gpu` one) while the block runs; yields its lease.
    SlotUnavailable when none comes free within `wait_s` (None: wait_bound_s())."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        lease_id = _acquire(client, name, wait_bound_s() if wait_s is None else wait_s)
        record = records_dir() / f"{lease_id}.json"
        stop = threading.Event()
        renewer = threading.Thread(target=_renew, args=(client, lease_id, stop), daemon=True)
        try:
            me = os.getpid()
            held = {
                "lease_id": str(lease_id),
                "limit": name,
                "host": socket.gethostname(),
                "pid": me,
                "started": _started(me),
            }
            record.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(record, json.dumps(held))
            renewer.start()
            yield lease_id
        finally:
            stop.set()
            if renewer.is_alive():
                renewer.join(timeout=5)
            client.release_concurrency_slots_with_lease(lease_id)
            record.unlink(missing_ok=True)
