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
# Comma-separated agent names of a version with one adapter per agent; absent for a shared one.
TAG_AGENTS = "agents"

# Written at promotion: what was decided, and against which champion.
TAG_DECISION = "promotion.decision"
TAG_REASON = "promotion.reason"
TAG_CHAMPION_SCORE = "promotion.champion_score"
TAG_CHAMPION_VERSION = "promotion.champion_version"
# Values of TAG_DECISION, and of the champion tags when there was no champion (or no score).
PROMOTED = "promoted"
REJECTED = "rejected"
NONE = "none"
