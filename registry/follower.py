"""The alias follower of `lightning-rl production`: the registry's champion and challenger
aliases made into what the running server serves, the live gate run on the canary's feedback,
and a failing champion rolled back.

It runs beside the server (the `production` command's process), talks to MLflow here and to the
server over its HTTP API with the admin key, so that the server itself needs no MLflow. Each
look (`step`): read the aliases; download each new version's adapter beside the store and
publish it as a policy version (the server loads it through the adapter rules before it is
servable); put the routing (gateway/routing.py), which the server swaps in whole between calls;
then ask the live gate about a canary and the rollback rule about the champion, whose decisions
move the aliases, which the next look follows. Looks happen every `poll_s`, and at once when
the reload webhook (webhook.py) is nudged by MLflow or a Prefect automation.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import httpx

from lightning_core.errors import LightningError
from lightning_core.gateway.routing import Routing
from lightning_core.security.keys import bearer_header
from lightning_core.stats.sequential import live_gate, rollback_reason
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import mlflow_client, reachable
from lightning_rl.registry.history import champion_history
from lightning_rl.registry.live import aliases, decide_canary, rollback
from lightning_rl.registry.live_config import LiveConfig
from lightning_rl.registry.versions import champion_adapter

logger = logging.getLogger(__name__)

_TIMEOUT_S = 120.0  # loading an adapter on every replica takes seconds on a busy machine


class Swap(NamedTuple):
    """A routing the server took, and when (time.time())."""

    at: float
    routing: Routing


def version_name(registered_model: str, version: str) -> str:
    """The policy version name a registered version is served under (as `production` names it)."""
    return f"{registered_model}-v{version}"


class AliasFollower:
    """Follows the aliases of `registry.registered_model` onto the server at `server_url`."""

    def __init__(
        self,
        registry: RegistryConfig,
        live: LiveConfig,
        server_url: str,
        api_key: str | None,
        adapters: Path,
        base_model: str,
    ) -> None:
        self.registry, self.live = registry, live
        self.adapters, self.base_model = adapters, base_model
        self.http = httpx.Client(
            base_url=server_url.rstrip("/"), headers=bearer_header(api_key), timeout=_TIMEOUT_S
        )
        self.status = ""
        self.swaps: list[Swap] = []
        self._routing: Routing | None = None
        self._canary_since: float | None = None
        # Policy version name -> registry version, of the versions published on the server.
        self._published: dict[str, str] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="alias-follower", daemon=True)

    # --- the loop ---------------------------------------------------------------------------

    def nudge(self) -> None:
        """Look now (a webhook delivery, a Prefect automation)."""
        self._wake.set()

    def start(self) -> AliasFollower:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        # A look in progress ends within its HTTP timeouts; the thread is a daemon anyway.
        self._thread.join(timeout=10)
        self.http.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except (LightningError, httpx.HTTPError) as exc:
                # The registry or the server unreachable for a while: the next look retries.
                logger.warning("alias follower: %s", exc)
            except Exception:
                logger.exception("alias follower: unexpected error; retrying at the next look")
            self._wake.wait(self.live.poll_s)
            self._wake.clear()

    def step(self) -> None:
        """One look: follow the aliases, then let the live gate and the rollback rule decide;
        a decision moves the aliases, which are followed again at once."""
        self.follow()
        if self.gate() or self.check_rollback():
            self.follow()

    # --- following the aliases ------------------------------------------------------------------

    def follow(self) -> Routing:
        """Make the server serve what the aliases name; returns the routing it serves."""
        found = aliases(self.registry)
        champion, canary = found["champion"], found["canary"]
        routing = Routing(
            champion=None if champion is None else self._publish(champion),
            challenger=None if canary is None else self._publish(canary),
            canary_fraction=self.live.canary_fraction if canary is not None else 0.0,
            status=self.status,
        )
        if routing.challenger != (self._routing.challenger if self._routing else None):
            # A new canary (or, after a restart, the canary as found): compared from now on.
            self._canary_since = time.time() if routing.challenger is not None else None
        if routing != self._routing:
            self._put(routing)
        return routing

    def _put(self, routing: Routing) -> None:
        answer = self.http.put("/serving/routing", json=routing.model_dump(mode="json"))
        _raise_for(answer, "routing")
        before, self._routing = self._routing, routing
        served = (routing.champion, routing.challenger, routing.canary_fraction)
        # The gate's status changes at every look (its counts): a swap is recorded, and said at
        # INFO, only when what is served changes, so that a canary does not fill the log (and
        # this list) with the same line every poll.
        changed = before is None or served != (
            before.champion,
            before.challenger,
            before.canary_fraction,
        )
        if changed:
            self.swaps.append(Swap(time.time(), routing))
        logger.log(
            logging.INFO if changed else logging.DEBUG,
            "serving champion %s, challenger %s (canary %.0f%%)",
            *served[:2],
            100 * routing.canary_fraction,
        )

    def _publish(self, version: str) -> str:
        """The policy version serving registered version `version`, published on the server
        first if it is not there: its adapter downloaded beside the store, renamed into place
        whole, then registered (the server checks and loads it before it is servable)."""
        name = version_name(self.registry.registered_model, version)
        if name in self._published:
            return name
        known = self.http.get(f"/store/policy-versions/{quote(name, safe='')}")
        if known.status_code == 200:
            self._published[name] = version
            return name
        folder = self.adapters / name
        if not folder.exists():
            self.adapters.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.adapters, prefix=".download-") as tmp:
                found = champion_adapter(self.registry, version, dst=tmp)
                if found is None:
                    raise LightningError(
                        f"{self.registry.registered_model} v{version} vanished from the registry"
                    )
                os.replace(found.adapter, folder)
        answer = self.http.post(
            "/store/policy-versions",
            json={
                "name": name,
                "base_model": self.base_model,
                "adapter_path": str(folder),
                "metadata": {
                    "registered_model": self.registry.registered_model,
                    "version": version,
                },
            },
        )
        if answer.status_code != 409:  # published meanwhile: the same version, the same folder
            _raise_for(answer, f"publishing {name}")
        self._published[name] = version
        return name

    # --- the live gate and rollback -------------------------------------------------------------

    def feedback(self, window: int, since: float | None = None) -> dict[str, dict[str, Any]]:
        """Live feedback per policy version on the server, newest `window` episodes each
        (begun at or after `since`, if given)."""
        params: dict[str, Any] = {"window": window}
        if since is not None:
            params["since"] = since
        answer = self.http.get("/serving/routing", params=params)
        _raise_for(answer, "feedback")
        return {row["policy_version"]: row for row in answer.json()["feedback"]}

    def gate(self) -> bool:
        """The live gate on the canary, if one runs; True when it decided."""
        routing = self._routing
        if routing is None or routing.challenger is None or routing.champion is None:
            return False
        # Both arms over the same time, the canary's: traffic that drifts would otherwise
        # compare the challenger's recent episodes with the champion's older ones.
        stats = self.feedback(self.live.gate.max_episodes, self._canary_since)
        none = {"episodes": 0, "mean": 0.0, "variance": 0.0}
        champion, challenger = (
            (row["episodes"], row["mean"], row["variance"])
            for row in (stats.get(routing.champion, none), stats.get(routing.challenger, none))
        )
        decision = live_gate(champion, challenger, self.live.gate)
        self.status = f"live gate on {routing.challenger}: {decision.verdict}: {decision.reason}"
        if decision.verdict == "wait":
            return False
        version = self._published[routing.challenger]
        return decide_canary(self.registry, version, decision.verdict == "promote", decision.reason)

    def check_rollback(self) -> bool:
        """Roll the champion back when its live feedback falls below the previous champion's
        by the margin (RollbackConfig); True when it did."""
        rules = self.live.rollback
        routing = self._routing
        if not rules.enabled or routing is None or routing.champion is None:
            return False
        client = mlflow_client(self.registry)
        name = self.registry.registered_model
        with reachable(client.tracking_uri, f"reading the champions of {name}"):
            history = champion_history(client, name)
        current = self._published[routing.champion]
        earlier = [v for v in history if v != current]
        if not earlier:
            return False
        stats = self.feedback(rules.window)
        previous = version_name(name, earlier[-1])
        if routing.champion not in stats or previous not in stats:
            return False
        now, before = stats[routing.champion], stats[previous]
        reason = rollback_reason(
            (now["episodes"], now["mean"]), (before["episodes"], before["mean"]), rules
        )
        if reason is None:
            return False
        self.status = f"rolled back {routing.champion}: {reason}"
        try:
            rollback(self.registry, reason, expected=current)
        except LightningError as exc:  # moved meanwhile: the next look follows it
            logger.warning("automatic rollback not done: %s", exc)
            return False
        return True


def _raise_for(answer: httpx.Response, what: str) -> None:
    if answer.status_code >= 400:
        raise LightningError(
            f"the production server refused {what}: {answer.status_code} {answer.text[:500]}"
        )
