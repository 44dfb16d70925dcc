"""Span names and attribute keys of our own namespace, beside OpenTelemetry's GenAI conventions.

One place for these strings, so that the tracing side, the store and the adapter agree.
"""

# Which rollout attempt a span belongs to, when it arrives over OTLP without our envelope.
ROLLOUT_ID = "lightning.rollout_id"
ATTEMPT_ID = "lightning.attempt_id"

# A reward is a span of its own, so it is ordered among the LLM calls it follows.
REWARD_SPAN = "lightning.reward"
REWARD_VALUE = "lightning.reward.value"
REWARD_NAME = "lightning.reward.name"
# Of several named rewards, the primary one is the episode's return.
REWARD_PRIMARY = "lightning.reward.primary"
