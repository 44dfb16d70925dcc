"""What the registry decided during the drift demonstration, read back from MLflow, and whether
those decisions hang together: the demo checks its own bookkeeping, the quick test asserts it."""

from __future__ import annotations

from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import mlflow_client
from lightning_rl.registry.live import aliases
from lightning_rl.registry.names import (
    TAG_BENCHMARK_ID,
    TAG_CHAMPION_SCORE,
    TAG_DECISION,
    TAG_LIVE_DECISION,
    TAG_LIVE_REASON,
    TAG_ROLLBACK_REASON,
    TAG_SCORE,
)

SHOWN = (TAG_DECISION, TAG_LIVE_DECISION, TAG_LIVE_REASON, TAG_ROLLBACK_REASON, TAG_SCORE)


def versions(config: RegistryConfig) -> dict[str, dict[str, str]]:
    """Every version of the registered model: its decision tags (and score), by number."""
    client = mlflow_client(config)
    found = client.search_model_versions(f"name='{config.registered_model}'")
    return {
        str(v.version): {
            k: v.tags[k] for k in (*SHOWN, TAG_BENCHMARK_ID, TAG_CHAMPION_SCORE) if k in v.tags
        }
        for v in sorted(found, key=lambda v: int(v.version))
    }


def changes(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> list[str]:
    """The decisions recorded between two readings, one line each."""
    lines = []
    for version, tags in after.items():
        old = before.get(version, {})
        for tag in SHOWN[:4]:
            if tag in tags and tags[tag] != old.get(tag):
                lines.append(f"v{version} {tag}={tags[tag]}")
    return lines


def problems(
    config: RegistryConfig, first_champion: str, pinned: str, tags: dict[str, dict[str, str]]
) -> list[str]:
    """What does not hang together (empty: all does). The champion got there through the
    gates (week 0's, or promoted by the live gate); a challenger is in canary; nothing past the
    offline gate scored below the champion it was compared with on the pinned benchmark."""
    found = aliases(config)
    wrong = []
    champion, challenger = found["champion"], found["challenger"]
    if champion is None:
        wrong.append("no champion")
    elif champion != first_champion and tags[champion].get(TAG_LIVE_DECISION) != "promoted":
        wrong.append(f"champion v{champion} was not promoted by the live gate")
    in_canary = tags.get(challenger or "", {}).get(TAG_DECISION) == "canary"
    if challenger is not None and challenger != champion and not in_canary:
        wrong.append(f"challenger v{challenger} is not in canary")
    for version, t in tags.items():
        if version == first_champion or t.get(TAG_DECISION) not in ("canary", "promoted"):
            continue
        if t.get(TAG_BENCHMARK_ID) != pinned:
            wrong.append(f"v{version} was scored on {t.get(TAG_BENCHMARK_ID)}, not {pinned}")
        elif float(t[TAG_SCORE]) < float(t.get(TAG_CHAMPION_SCORE, "nan")):
            wrong.append(f"v{version} passed the offline gate below its champion's score")
    return wrong
