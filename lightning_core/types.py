"""The data model every part of lightning-rl shares: tasks, rollouts, attempts, spans, transitions.

Times are Unix seconds as floats (OpenTelemetry nanoseconds are converted on the way in), so that
rows compare and sort the same in Python, JSON and DuckDB.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
import uuid
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from lightning_core.backends.base import Constraint
from lightning_core.errors import IllegalTransition, InvalidInput, PayloadTooLarge

# Rewards must be real numbers: a NaN or an infinity poisons every mean it enters.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# The store keeps token ids and steps as DuckDB INTEGER (32 bits): larger ones are refused here,
# at the edge, rather than by the store's database after the writer was told they are stored.
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]

# Caps on the free-form JSON a client stores. The store keeps every rollout, episode and
# feedback row in memory and sends each one whole in every query that finds it, so one
# oversized value costs memory for as long as the store runs and time in every read.
# A task's input is a question, a schema, a few retrieved passages: the demo datasets' largest
# is a few KB; 1 MiB leaves room for long documents and stops a body-sized (64 MB) one.
MAX_INPUT_BYTES = 1024 * 1024
# Labels (metadata) are a handful of keys: 64 KiB is hundreds of them.
MAX_METADATA_BYTES = 64 * 1024


def check_payload_size(value: Any, field: str, cap: int) -> None:
    """PayloadTooLarge (a 413 over HTTP) naming `field` if `value` is over `cap` bytes as JSON."""
    try:
        size = len(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:
        raise ValueError(f"{field} is not a JSON value: {exc}") from None
    if size > cap:
        raise PayloadTooLarge(
            f"{field} is {size} bytes as JSON, over the cap of {cap} bytes: store a reference "
            "(a path, an id) instead of the data itself"
        )


def _capped(cap: int) -> AfterValidator:
    def check(value: Any, info: ValidationInfo) -> Any:
        check_payload_size(value, info.field_name or "value", cap)
        return value

    return AfterValidator(check)


# Free-form JSON a client stores, capped (the error is a PayloadTooLarge, not a ValueError, so
# that pydantic lets it through and the server answers 413 rather than 422).
StoredInput = Annotated[Any, _capped(MAX_INPUT_BYTES)]
Labels = Annotated[dict[str, Any], _capped(MAX_METADATA_BYTES)]


# ---------------------------------------------------------------------------- the reward range

# Every reward that enters (a reward span, an attempt's reward, an episode's feedback) must be a
# finite number within [-max_abs_reward, max_abs_reward]. Finite is not enough: one reward of
# 1e200 swamps every mean it enters and its square overflows (the variance of a group's returns,
# of a version's live feedback), so one agent or one feedback source could stop a training run
# or the serving routes. It is refused where it enters (a 400 naming the value, the bound and the
# setting) and never stored. The store's bound is its `max_abs_reward` setting; clients
# (emit_reward, the runner) and the training flow's collect read the same environment variable,
# so that they fail early with the same message.
MAX_ABS_REWARD_SETTING = "LIGHTNING_MAX_ABS_REWARD"
DEFAULT_MAX_ABS_REWARD = 1e6
# The widest range the setting allows: a sum of billions of squares of 1e100 is still far below
# the largest float (1.8e308), so no statistic over stored rewards can overflow.
LIMIT_MAX_ABS_REWARD = 1e100


def max_abs_reward() -> float:
    """The bound from LIGHTNING_MAX_ABS_REWARD in this process's environment, else the default:
    what clients check against (set it as on the server) and StoreConfig's default."""
    raw = os.environ.get(MAX_ABS_REWARD_SETTING, "").strip()
    if not raw:
        return DEFAULT_MAX_ABS_REWARD
    try:
        bound = float(raw)
    except ValueError:
        bound = math.nan
    if not 0 < bound <= LIMIT_MAX_ABS_REWARD:
        raise InvalidInput(
            f"{MAX_ABS_REWARD_SETTING}={raw!r} is not a number in (0, {LIMIT_MAX_ABS_REWARD:g}]"
        )
    return bound


def check_reward(value: Any, what: str, bound: float | None = None) -> float:
    """`value` as a float if it is a number within the reward range (`bound`, default
    max_abs_reward()); InvalidInput naming `what`, the value, the bound and the setting if not."""
    # An int is compared exactly: math.isfinite would overflow on a huge one.
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not finite:
        raise InvalidInput(f"{what} must be a finite number, got {value!r}")
    bound = max_abs_reward() if bound is None else bound
    if abs(value) > bound:
        setting = MAX_ABS_REWARD_SETTING
        raise InvalidInput(
            f"{what} is {value!r}, outside the reward range [-{bound:g}, {bound:g}] ({setting}): "
            f"rescale the reward, or raise {setting} on the server and its clients alike"
        )
    return float(value)


def in_reward_range(value: Any, bound: float) -> bool:
    """Whether `value` is a number within the reward range `bound` (check_reward's test)."""
    try:
        check_reward(value, "value", bound)
    except InvalidInput:
        return False
    return True


# Statistics over rewards that stay finite for any finite values (such as rewards stored before
# the range was checked), with the bits of plain arithmetic for ordinary ones.


def scale_exponent(values: Sequence[float]) -> int:
    """k such that every value times 2**-k is below 1 in magnitude (0 for no values). Scaling by
    a power of two is exact, so sums and squares of the scaled values lose nothing."""
    big = max((abs(v) for v in values), default=0.0)
    return math.frexp(big)[1] if math.isfinite(big) else 0


def scale_up(value: float, k: int) -> float:
    """value * 2**k, saturated at the largest float rather than overflowing."""
    try:
        return math.ldexp(value, k)
    except OverflowError:
        return math.copysign(sys.float_info.max, value)


def finite_mean(values: Sequence[float]) -> float:
    """sum(values) / len(values); where that sum overflows, the mean of the values scaled down
    (exactly) first."""
    total = sum(values)
    if math.isfinite(total):
        return total / len(values)
    k = scale_exponent(values)
    return scale_up(sum(math.ldexp(v, -k) for v in values) / len(values), k)


def finite_variance(values: Sequence[float], ddof: int = 1) -> float:
    """sum((v - mean) ** 2) / max(n - ddof, 1); where a square overflows, computed on the values
    scaled down, and saturated at the largest float."""
    m = finite_mean(values)
    divisor = max(len(values) - ddof, 1)
    try:
        result = sum((v - m) ** 2 for v in values) / divisor
    except OverflowError:  # float ** 2 raises where it overflows (v - m may be inf instead)
        result = math.inf
    if math.isfinite(result):
        return result
    k = scale_exponent(values)
    scaled = [math.ldexp(v, -k) for v in values]
    m = finite_mean(scaled)
    return scale_up(sum((v - m) ** 2 for v in scaled) / divisor, 2 * k)


def new_id(prefix: str) -> str:
    """A short random id; 48 random bits keep collisions negligible at millions of rows."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def now() -> float:
    return time.time()


class _Model(BaseModel):
    # Unknown fields are an error: a typo in a client must not silently drop data.
    model_config = ConfigDict(extra="forbid")


class RolloutMode(StrEnum):
    train = "train"
    val = "val"
    test = "test"
    # An episode captured from production traffic through the gateway (open_episode): never
    # queued, never claimed by a runner, never timed out; its reward arrives later as feedback.
    production = "production"


class RolloutStatus(StrEnum):
    queuing = "queuing"
    running = "running"
    requeuing = "requeuing"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    def check_move(self, to: RolloutStatus, what: str) -> None:
        """Raise IllegalTransition unless the lifecycle allows `self -> to`."""
        if to not in _ROLLOUT_MOVES[self]:
            raise IllegalTransition(
                f"{what} is {self.value} and cannot become {to.value}; allowed from "
                f"{self.value}: {', '.join(s.value for s in _ROLLOUT_MOVES[self]) or 'nothing'}"
            )


_FINISHED = frozenset({RolloutStatus.succeeded, RolloutStatus.failed, RolloutStatus.cancelled})
_ROLLOUT_MOVES: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    RolloutStatus.queuing: frozenset({RolloutStatus.running, RolloutStatus.cancelled}),
    RolloutStatus.running: frozenset(
        {
            RolloutStatus.succeeded,
            RolloutStatus.failed,
            RolloutStatus.cancelled,
            RolloutStatus.requeuing,
        }
    ),
    RolloutStatus.requeuing: frozenset({RolloutStatus.running, RolloutStatus.cancelled}),
    RolloutStatus.succeeded: frozenset(),
    RolloutStatus.failed: frozenset(),
    RolloutStatus.cancelled: frozenset(),
}


class AttemptStatus(StrEnum):
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    # The attempt ran past its time budget.
    timeout = "timeout"
    # The worker stopped sending heartbeats and spans.
    unresponsive = "unresponsive"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self is not AttemptStatus.running


class Task(_Model):
    """One item of a dataset: what an agent is asked to do."""

    id: str = Field(description="Stable id of the task within its dataset.")
    input: Any = Field(description="The payload handed to the agent (any JSON value).")
    split: str = Field("train", description="Dataset split: train, val or test.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free-form labels.")


class RolloutRequest(_Model):
    """What the algorithm side enqueues; the store turns it into a Rollout."""

    input: StoredInput = Field(
        description=f"The task payload handed to the agent (any JSON value, at most "
        f"{MAX_INPUT_BYTES} bytes)."
    )
    rollout_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="Id to enqueue the rollout under; a request whose id the store knows is "
        "answered with that rollout instead of enqueuing another, so an enqueue whose answer "
        "was lost can be sent again. None: the store picks one.",
    )
    task_id: str | None = Field(None, description="Id of the task this rollout runs.")
    group_id: str | None = Field(
        None, description="Rollouts of one group share a baseline for grouped advantages (GRPO)."
    )
    mode: RolloutMode = Field(RolloutMode.train, description="train, val or test.")
    policy_version: str | None = Field(None, description="Policy version the agent must use.")
    max_attempts: int = Field(
        1, ge=1, le=100, description="Attempts before the rollout is marked failed."
    )
    metadata: Labels = Field(
        default_factory=dict, description=f"Free-form labels, at most {MAX_METADATA_BYTES} bytes."
    )

    @classmethod
    def for_task(cls, task: Task, **kwargs: Any) -> RolloutRequest:
        return cls(input=task.input, task_id=task.id, **kwargs)

    @model_validator(mode="after")
    def _not_an_episode(self) -> RolloutRequest:
        if self.mode is RolloutMode.production or (self.rollout_id or "").startswith(
            EPISODE_ROLLOUT_PREFIX
        ):
            raise ValueError(
                "a production rollout (mode production, id starting with 'ep-') is not "
                "enqueued: it is an episode the gateway opens for calls carrying an episode id"
            )
        return self


class Rollout(_Model):
    """One episode of an agent on one task, possibly over several attempts."""

    rollout_id: str
    input: Any
    task_id: str | None = None
    group_id: str | None = None
    mode: RolloutMode = RolloutMode.train
    status: RolloutStatus = RolloutStatus.queuing
    policy_version: str | None = None
    max_attempts: int = 1
    attempt_count: int = Field(0, description="Attempts claimed so far.")
    episode_return: FiniteFloat | None = None
    enqueued_at: float
    started_at: float | None = None
    ended_at: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class Attempt(_Model):
    """One try of a worker at a rollout; a retry is a new attempt with the next sequence id."""

    attempt_id: str
    rollout_id: str
    sequence_id: int = Field(description="1 for the first attempt of the rollout, then 2, ...")
    worker_id: str
    status: AttemptStatus = AttemptStatus.running
    started_at: float
    ended_at: float | None = None
    last_heartbeat_at: float
    error: str | None = None


class Claim(_Model):
    """What `dequeue` hands a worker: the rollout and the attempt it now owns."""

    rollout: Rollout
    attempt: Attempt


class SpanKind(StrEnum):
    internal = "internal"
    server = "server"
    client = "client"
    producer = "producer"
    consumer = "consumer"


class SpanStatusCode(StrEnum):
    unset = "unset"
    ok = "ok"
    error = "error"


class SpanEvent(_Model):
    name: str
    timestamp: float
    attributes: dict[str, Any] = Field(default_factory=dict)


class Span(_Model):
    """An OpenTelemetry span tied to the rollout attempt that produced it."""

    rollout_id: str
    attempt_id: str
    sequence_id: int | None = Field(
        None, description="Order of arrival in the store; assigned by the store."
    )
    trace_id: str = Field(description="32 hex digits.")
    span_id: str = Field(description="16 hex digits.")
    parent_id: str | None = Field(None, description="span_id of the parent, if any.")
    name: str
    kind: SpanKind = SpanKind.internal
    start_time: float
    end_time: float | None = None
    status_code: SpanStatusCode = SpanStatusCode.unset
    status_message: str | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    events: list[SpanEvent] = Field(default_factory=list)
    resource: dict[str, Any] = Field(default_factory=dict)


class Transition(_Model):
    """One LLM call of a rollout, as the trainer consumes it."""

    rollout_id: str
    attempt_id: str | None = None
    step: int = Field(
        ge=0, le=INT32_MAX, description="Order of the call within the rollout, from 0."
    )
    agent_name: str | None = None
    prompt_token_ids: list[TokenId]
    response_token_ids: list[TokenId]
    response_logprobs: list[FiniteFloat] = Field(default_factory=list)
    reward: FiniteFloat = 0.0
    advantage: FiniteFloat | None = None
    policy_version: str | None = None
    temperature: FiniteFloat = Field(
        1.0,
        ge=0,
        description="Temperature the response was sampled at; its logprobs are of the tempered "
        "distribution, and training tempers its own the same way (0, greedy, reports T = 1).",
    )
    top_p: FiniteFloat = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus mass it was sampled with (the logprobs are before the nucleus cut).",
    )
    output_constraint: Constraint | None = Field(
        None,
        description="The grammar the response was decoded under (structured outputs); its "
        "logprobs are those of the masked distribution, and training masks the same way.",
    )
    finish_reason: str | None = Field(
        None,
        description="Why the response ended: stop, length (cut at the token limit, which "
        "overlong filtering leaves out of the loss), tool_calls; None: not recorded.",
    )
    adapter_hash: str | None = Field(
        None,
        description="Content hash of the adapter the gateway served the call with "
        "(security/provenance.py); None: the base model, or not recorded.",
    )
    template_fingerprint: str | None = Field(
        None,
        description="Fingerprint of the tokenizer and chat template that rendered the prompt; "
        "None: not recorded.",
    )


class PolicyVersion(_Model):
    """A servable policy: a base model, optionally with a LoRA adapter on top."""

    name: str = Field(min_length=1, description="Unique name the gateway serves it under.")
    base_model: str = Field(description="Hub id or local folder of the base model.")
    adapter_path: str | None = Field(None, description="PEFT adapter folder; None = base model.")
    agent_policies: dict[str, str] = Field(
        default_factory=dict,
        description="One policy per agent: agent name (X-Lightning-Agent) -> the policy version "
        "that serves that agent's calls. Calls of other agents get this version's own adapter.",
    )
    created_at: float = Field(default_factory=now)
    metadata: dict[str, Any] = Field(default_factory=dict)


class Sampling(_Model):
    """How a rollout's model calls sample, as the algorithm asks for it: from the training
    config (TrainConfig.rollouts.sampling) through the rollout's metadata and the runner to the
    agent's endpoint (`LLMEndpoint.sampling`, as the client's keyword arguments). Unset fields
    are the agent's or the gateway's defaults."""

    temperature: float | None = Field(
        None, ge=0, description="Sampling temperature; 0 is greedy (evaluation)."
    )
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens of one completion.")
    seed: int | None = Field(
        None,
        description="Seed of the rollout's first call (a run sets one per rollout from its own "
        "seed; a retried attempt samples anew).",
    )

    def as_kwargs(self) -> dict[str, Any]:
        """The fields that are set, as an OpenAI client's keyword arguments."""
        return self.model_dump(exclude_none=True)

    def for_attempt(self, sequence_id: int) -> Sampling:
        """The sampling of a rollout's `sequence_id`-th attempt: a retry samples anew, since
        the same seed would replay the attempt that failed."""
        if self.seed is None or sequence_id == 1:
            return self
        return self.model_copy(update={"seed": self.seed + (sequence_id - 1) * 1_000_003})


class LLMEndpoint(_Model):
    """What an agent gets to reach the policy: any OpenAI-compatible client works with it."""

    base_url: str = Field(description="OpenAI-compatible base URL, ending in /v1.")
    model: str = Field(description="Model name to request: the policy version to use.")
    api_key: str = Field(
        "lightning", description="Bearer token (the server's API key; any value when it has none)."
    )
    sampling: dict[str, Any] = Field(
        default_factory=dict,
        description="Sampling the algorithm asks for (temperature, top_p, max_tokens, seed: "
        "Sampling.as_kwargs()); an agent passes these to its client where it can. Evaluation "
        "asks for temperature 0.",
    )


# ---------------------------------------------------------------------------- production episodes

# An episode id comes from a production agent (a session or conversation id); `:` is allowed for
# ids such as "tenant:session". 128 characters bound what one header may make the store keep.
EPISODE_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"
FEEDBACK_SOURCE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}"
_EPISODE_ID = re.compile(EPISODE_ID_PATTERN)
# The rollout of an episode is named after it, so that the same id always finds the same rollout.
EPISODE_ROLLOUT_PREFIX = "ep-"


def episode_rollout_id(episode_id: str) -> str:
    """The id of the rollout that records episode `episode_id`; InvalidInput for a bad id."""
    if not isinstance(episode_id, str) or _EPISODE_ID.fullmatch(episode_id) is None:
        raise InvalidInput(
            f"episode id {str(episode_id)[:200]!r} is not valid: use 1 to 128 letters, digits, "
            "'.', '_', ':' or '-', starting with a letter or a digit"
        )
    return f"{EPISODE_ROLLOUT_PREFIX}{episode_id}"


# A feedback value must be a JSON number: a string ("0.5", "NaN") is refused, not coerced, so a
# client that sends the wrong type learns it at once instead of training on what we guessed.
FeedbackValue = Annotated[float, Field(allow_inf_nan=False, strict=True)]


class FeedbackIn(_Model):
    """A reward for a production episode, given after the fact (a user's rating, a check)."""

    value: FeedbackValue = Field(
        description="The reward: a finite number within the server's reward range "
        "(LIGHTNING_MAX_ABS_REWARD, default +-1e6; outside it, refused with a 400)."
    )
    source: str = Field(
        "user",
        pattern=f"^{FEEDBACK_SOURCE_PATTERN}$",
        description="Who or what gave it (user, judge, tests, ...); one value counts per "
        "(episode, source), the newest.",
    )
    time: FiniteFloat | None = Field(
        None,
        ge=0,
        description="When the signal happened, in seconds since the epoch; None: now.",
    )
    comment: str | None = Field(None, max_length=2000, description="Free text, e.g. why.")
    metadata: Labels = Field(
        default_factory=dict, description=f"Free-form labels, at most {MAX_METADATA_BYTES} bytes."
    )


class Feedback(_Model):
    """A recorded feedback row; the newest per (episode, source) is the one that counts."""

    seq: int = Field(
        description="Store-wide order of recorded changes, strictly increasing: a run that "
        "read everything up to seq S reads what came later with after_seq=S."
    )
    episode_id: str
    source: str
    value: FiniteFloat
    time: float = Field(description="When the signal happened (seconds since the epoch).")
    recorded_at: float = Field(description="When the store recorded it.")
    comment: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class FeedbackReceipt(_Model):
    """The answer to a feedback: the row that counts now, and what the feedback changed."""

    feedback: Feedback
    status: Literal["recorded", "unchanged", "replaced"] = Field(
        description="recorded: the first of its (episode, source); unchanged: the same value "
        "and comment again (no new row); replaced: a new value, with a new seq."
    )
