"""The registry's vocabulary: the aliases and the version tags, one name per fact, shared by
what writes them (registration, promotion) and what reads them back (lookups, the MLflow UI,
tests). Plain strings, without MLflow."""

from __future__ import annotations

# Aliases of the registered model: the version evaluation and serving pick up, and the latest
# registered one, promoted or not.
CHAMPION = "champion"
CHALLENGER = "challenger"

# Written at registration: what the version is.
TAG_POLICY_VERSION = "policy_version"
TAG_ITERATION = "iteration"
TAG_BASE_MODEL = "base_model"
TAG_SCORE = "eval.score"
# What TAG_SCORE was measured on (lightning_core.stats.evaluation.benchmark_id) and its task count.
TAG_BENCHMARK_ID = "eval.benchmark_id"
TAG_BENCHMARK_SIZE = "eval.benchmark_size"
# Comma-separated agent names of a version with one adapter per agent; absent for a shared one.
TAG_AGENTS = "agents"

# Written at promotion: what was decided, and against which champion.
TAG_DECISION = "promotion.decision"
TAG_REASON = "promotion.reason"
TAG_CHAMPION_SCORE = "promotion.champion_score"
TAG_CHAMPION_VERSION = "promotion.champion_version"
# The benchmark both scores of the decision are on.
TAG_DECISION_BENCHMARK = "promotion.benchmark_id"
# Values of TAG_DECISION, and of the champion tags when there was no champion (or no score).
PROMOTED = "promoted"
REJECTED = "rejected"
# Past the offline gate, with `RegistryConfig.live_gate`: the live gate on canary traffic decides.
CANARY = "canary"
NONE = "none"

# Written by the live gate and by rollbacks (registry/live.py, registry/rollback.py).
TAG_LIVE_DECISION = "live.decision"
TAG_LIVE_REASON = "live.reason"
TAG_ROLLBACK_REASON = "rollback.reason"
# A registered model's tag: the versions that were champion before the current one, oldest
# first, as JSON (at most CHAMPION_HISTORY_LENGTH): what a rollback returns to.
TAG_CHAMPION_HISTORY = "champion.history"
CHAMPION_HISTORY_LENGTH = 20


def score_tag(benchmark_id: str) -> str:
    """The tag of a version's score on benchmark `benchmark_id` when it was scored there after
    its registration (`lightning-rl eval`); the registration's score is TAG_SCORE."""
    return f"{TAG_SCORE}.{benchmark_id}"


def benchmark_size_tag(benchmark_id: str) -> str:
    """The tag of the size of benchmark `benchmark_id`, beside score_tag."""
    return f"{TAG_BENCHMARK_SIZE}.{benchmark_id}"


# The registered model whose versions are the tickets of the promotion lock of model `name`
# (registry/lock.py), and the tags of a ticket.
LOCK_SUFFIX = ".promotion-lock"
TAG_LOCK_OWNER = "lock.owner"
TAG_LOCK_EXPIRES = "lock.expires_at"
