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

# One LLM call through the gateway: the exact token ids the backend consumed and produced.
PROMPT_TOKEN_IDS = "lightning.prompt_token_ids"
# Per choice i of the call: RESPONSE.format(i=i, key="token_ids" | "logprobs" | "finish_reason").
RESPONSE = "lightning.response.{i}.{key}"
RESPONSE_COUNT = "lightning.response.count"
POLICY_VERSION = "lightning.policy_version"
# What answered, beyond the version's name (security/provenance.py): the content hash of the
# adapter the gateway loaded for it (absent for the base model), and the fingerprint of the
# tokenizer and chat template that rendered the prompt.
ADAPTER_HASH = "lightning.adapter_hash"
TEMPLATE_FINGERPRINT = "lightning.template_fingerprint"
# The key of a policy version's metadata under which its publisher declares its adapter's
# content hash: the gateway refuses a folder whose bytes no longer match it.
ADAPTER_HASH_METADATA = "adapter_hash"
# The client API a call came in through (chat.completions, completions, responses, messages).
API = "lightning.api"
# Set when the call's output was constrained to a grammar: json_object, json_schema or grammar.
CONSTRAINT = "lightning.constraint"
# Its JSON schema (json_schema only), as JSON text: the trainer replays the grammar from it.
CONSTRAINT_SCHEMA = "lightning.constraint.json_schema"
# Its Lark grammar (kind grammar only), for the same replay.
CONSTRAINT_GRAMMAR = "lightning.constraint.grammar"
AGENT_NAME = "lightning.agent_name"
# What only the gateway writes, on the spans of the calls it answers: a training transition is
# made of them, and provenance checks them. A span an agent's key writes over HTTP may carry
# none of them (store/guards.py): every key that starts with the prefix (the choices' token ids,
# logprobs, finish reasons and their count) and the keys of the set.
GATEWAY_ONLY_PREFIX = "lightning.response."
GATEWAY_ONLY = frozenset(
    {
        PROMPT_TOKEN_IDS,
        POLICY_VERSION,
        ADAPTER_HASH,
        TEMPLATE_FINGERPRINT,
        API,
        CONSTRAINT,
        CONSTRAINT_SCHEMA,
        CONSTRAINT_GRAMMAR,
    }
)
# The header (or request metadata key) an agent names itself with in a multi-agent system.
AGENT_HEADER = "X-Lightning-Agent"
AGENT_METADATA_KEY = "agent_name"
# The header (or request metadata key) a production agent names its episode with (a session or
# conversation id), on the plain /v1 routes; the gateway records the call on that episode and
# answers with the header (with a new id when it captures every call).
EPISODE_HEADER = "X-Lightning-Episode"
EPISODE_METADATA_KEY = "episode_id"
# The header of a gateway answer that names the policy version which answered it (the span's
# POLICY_VERSION): under a canary or across a hot reload, one version per call.
POLICY_VERSION_HEADER = "X-Lightning-Policy-Version"

# Spans an agent's code emits with the tracing API.
TOOL_SPAN = "lightning.tool"
TOOL_NAME = "lightning.tool.name"
TOOL_SUCCESS = "lightning.tool.success"
OPERATION_SPAN_PREFIX = "lightning.operation"

# A judge (lightning_core/judge): its calls name themselves with this agent name, and are never
# trained on, wherever they are recorded; its verdict on a rollout is a span of its own.
JUDGE_AGENT = "lightning-judge"
JUDGE_SPAN = "lightning.judge"
JUDGE_SCORE = "lightning.judge.score"
JUDGE_MODEL = "lightning.judge.model"
JUDGE_MODE = "lightning.judge.mode"
JUDGE_CACHED = "lightning.judge.cached"
JUDGE_ERROR = "lightning.judge.error"
