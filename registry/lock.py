"""The promotion lock: promotions of one registered model run one at a time, across threads,
processes and machines that share the tracking server, with no server beside MLflow.

MLflow has no lock, but it numbers a registered model's versions atomically: a version is a
row unique on (name, version), numbered one past the highest ever given (deleted versions keep
their numbers), and a collision is retried; the tracking server does the same through its
store. The lock is a ticket queue on that. A promotion registers a version of the model
`<name>.promotion-lock` as its ticket and holds the lock while its ticket is the lowest live
one; it releases by deleting its own ticket, so no release can free someone else's lock.

A ticket carries its owner and an expiry. A waiter pushes its own expiry on while it waits; a
holder that crashed (or was cut off from the server) blocks the others only until its ticket
expires, when they pass it and delete it. That is a lease: a holder must finish within
`ttl_s` (a promotion takes seconds), and the machines must agree on the time to well within it.
A process whose release failed (the server was down) takes the same ticket again on its next
try, keeping its place: the retry of a promotion cut short finishes it before others decide.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode

from lightning_core.errors import LightningError
from lightning_rl.registry.connection import filter_literal
from lightning_rl.registry.names import LOCK_SUFFIX, TAG_LOCK_EXPIRES, TAG_LOCK_OWNER

logger = logging.getLogger(__name__)

# A ticket is no model: its source only has to pass the tracking server's checks of one
# (absolute, not a local path).
_TICKET_SOURCE = "lightning-lock:/promotion"
# Between looks at the queue: a promotion holds the lock for about a second.
_POLL_S = 0.2

# Tickets this process could not release (tracking URI, lock model) -> (version, owner):
# taken again by the next acquisition here.
_unreleased: dict[tuple[str, str], tuple[str, str]] = {}


class RegistryBusy(LightningError):
    """The promotion lock stayed held past the wait, or was lost past its expiry."""

    status_code = 409


@dataclass
class Ticket:
    """A place in the promotion queue of one registered model: a version of its lock model."""

    client: MlflowClient
    lock_model: str
    version: str
    owner: str
    ttl_s: float

    def renew(self) -> None:
        """Push the expiry on, and make sure the ticket is still ours: called before a holder
        writes, so that one that overran its lease fails rather than write over a successor."""
        try:
            held = self.client.get_model_version(self.lock_model, self.version)
        except MlflowException as e:
            if e.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise
            held = None
        if held is None or held.tags.get(TAG_LOCK_OWNER) != self.owner:
            raise RegistryBusy(
                f"the promotion lock of {self.lock_model.removesuffix(LOCK_SUFFIX)} was taken "
                f"over: this promotion held it past its {self.ttl_s:g} s (registry.lock_ttl_s); "
                "nothing was written, and a retry queues again"
            )
        self._push_expiry()

    def _push_expiry(self) -> None:
        expires = repr(time.time() + self.ttl_s)
        self.client.set_model_version_tag(self.lock_model, self.version, TAG_LOCK_EXPIRES, expires)


def _expires_at(ticket: ModelVersion) -> float:
    try:
        return float(ticket.tags[TAG_LOCK_EXPIRES])
    except (KeyError, ValueError):
        return 0.0  # not a ticket this module wrote: expired


def _missing(e: MlflowException) -> bool:
    return e.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)


def _ensure_lock_model(client: MlflowClient, lock_model: str, name: str) -> None:
    try:
        client.create_registered_model(
            lock_model,
            description=f"Tickets of the lock that serialises promotions of {name}; not a "
            "model. A version is a promotion waiting or running; leave them be.",
        )
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def _new_ticket(client: MlflowClient, lock_model: str, ttl_s: float) -> Ticket:
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    created = client.create_model_version(
        lock_model,
        _TICKET_SOURCE,
        tags={TAG_LOCK_OWNER: owner, TAG_LOCK_EXPIRES: repr(time.time() + ttl_s)},
        await_creation_for=0,
    )
    return Ticket(client, lock_model, str(created.version), owner, ttl_s)


def _reclaimed(client: MlflowClient, lock_model: str, ttl_s: float) -> Ticket | None:
    """The ticket this process failed to release, if it is still ours (not yet passed as
    expired): the same place in the queue."""
    left = _unreleased.pop((client.tracking_uri, lock_model), None)
    if left is None:
        return None
    ticket = Ticket(client, lock_model, left[0], left[1], ttl_s)
    try:
        ticket.renew()
    except RegistryBusy:
        return None
    except MlflowException:
        _unreleased[(client.tracking_uri, lock_model)] = left  # for the try after this one
        raise
    logger.info("promotion lock: took back ticket %s of %s", ticket.version, lock_model)
    return ticket


def _tickets(client: MlflowClient, lock_model: str) -> list[ModelVersion]:
    quoted = filter_literal(lock_model)
    query = f"name = {quoted}" if quoted else ""
    found = [v for v in client.search_model_versions(query) if v.name == lock_model]
    return sorted(found, key=lambda v: int(v.version))


def _delete_expired(client: MlflowClient, tickets: list[ModelVersion]) -> None:
    for ticket in tickets:
        logger.warning(
            "promotion lock: passing ticket %s of %s, expired (owner %s)",
            ticket.version,
            ticket.name,
            ticket.tags.get(TAG_LOCK_OWNER),
        )
        try:
            client.delete_model_version(ticket.name, ticket.version)
        except MlflowException as e:
            if not _missing(e):  # another waiter deleted it first
                raise


def _wait_turn(ticket: Ticket, wait_s: float) -> None:
    """Wait until `ticket` is the lowest live one: the lock is held. A ticket passed as expired
    while its waiter was stalled is replaced, in place, by a new one at the end of the queue."""
    client, lock_model = ticket.client, ticket.lock_model
    deadline = time.monotonic() + wait_s
    while True:
        now = time.time()
        tickets = _tickets(client, lock_model)
        if all(str(t.version) != ticket.version for t in tickets):
            # Expired and passed while this waiter was stalled: queue again.
            logger.warning("promotion lock: ticket %s of %s was passed", ticket.version, lock_model)
            fresh = _new_ticket(client, lock_model, ticket.ttl_s)
            ticket.version, ticket.owner = fresh.version, fresh.owner
            continue
        ahead = [t for t in tickets if int(t.version) < int(ticket.version)]
        expired = [t for t in ahead if _expires_at(t) < now]
        live = [t for t in ahead if _expires_at(t) >= now]
        if not live:
            _delete_expired(client, expired)
            return
        if time.monotonic() >= deadline:
            holder = live[0]
            raise RegistryBusy(
                f"waited {wait_s:g} s for the promotion lock of "
                f"{lock_model.removesuffix(LOCK_SUFFIX)}, held by "
                f"{holder.tags.get(TAG_LOCK_OWNER)} (version {holder.version} of {lock_model}, "
                f"expiring in {_expires_at(holder) - now:.0f} s); retry later, raise "
                "registry.lock_wait_s, or delete that version if its holder is gone"
            )
        ticket._push_expiry()
        time.sleep(_POLL_S)


def _release(ticket: Ticket) -> None:
    try:
        ticket.client.delete_model_version(ticket.lock_model, ticket.version)
    except MlflowException as e:
        if _missing(e):
            logger.warning(
                "promotion lock: ticket %s of %s was passed as expired before its release",
                ticket.version,
                ticket.lock_model,
            )
            return
        _unreleased[(ticket.client.tracking_uri, ticket.lock_model)] = (
            ticket.version,
            ticket.owner,
        )
        logger.warning(
            "promotion lock: could not release ticket %s of %s (%s); it expires in %g s, or "
            "this process takes it again",
            ticket.version,
            ticket.lock_model,
            str(e).splitlines()[0],
            ticket.ttl_s,
        )


@contextlib.contextmanager
def promotion_lock(
    client: MlflowClient, name: str, ttl_s: float, wait_s: float
) -> Iterator[Ticket]:
    """Hold the promotion lock of registered model `name` inside the block.

    Waits at most `wait_s` (then RegistryBusy); `ttl_s` is the lease: how long the ticket stays
    live without renewal. Call the ticket's renew() before writing what the lock protects.
    """
    lock_model = name + LOCK_SUFFIX
    _ensure_lock_model(client, lock_model, name)
    ticket = _reclaimed(client, lock_model, ttl_s) or _new_ticket(client, lock_model, ttl_s)
    try:
        _wait_turn(ticket, wait_s)
        yield ticket
    finally:
        _release(ticket)
