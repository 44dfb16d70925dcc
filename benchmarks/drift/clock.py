"""How long a promotion takes to reach users in the drift demonstration: from the registry's
`champion` alias moving to the first call the production server answers with the new version."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from lightning_core.errors import LightningError
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.follower import version_name
from lightning_rl.registry.live import aliases


@dataclass
class PromotionClock:
    """Times each move of `champion` to the first call the server answers with the new
    version: a thread that reads the alias and makes a one-token probe call every `every_s`
    (the move is seen up to `every_s` late, so a time may be short by up to that)."""

    config: RegistryConfig
    url: str
    key: str
    every_s: float
    times: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> PromotionClock:
        # Read here, where a registry that cannot be reached fails the demo at once.
        self._champion = aliases(self.config)["champion"]
        self._thread = threading.Thread(target=self._run, name="promotion-clock", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _served(self, http: httpx.Client) -> str | None:
        answer = http.post(
            f"{self.url}/v1/chat/completions",
            json={
                "model": "champion",
                "messages": [{"role": "user", "content": "1"}],
                "max_tokens": 1,
            },
        )
        return answer.headers.get("X-Lightning-Policy-Version")

    def _run(self) -> None:
        champion = self._champion
        moved_at: float | None = None
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(headers=headers, timeout=60) as http:
            while not self._stop.wait(self.every_s):
                try:
                    now = aliases(self.config)["champion"]
                    if now != champion:
                        champion, moved_at = now, time.monotonic()
                    if moved_at is not None and champion is not None:
                        wanted = version_name(self.config.registered_model, champion)
                        if self._served(http) == wanted:
                            self.times.append(round(time.monotonic() - moved_at, 2))
                            moved_at = None
                except (httpx.HTTPError, OSError, LightningError) as exc:
                    print(f"promotion clock: {exc}", flush=True)
