"""What one call, and one rollout attempt, may ask of the gateway.

A long-lived gateway answers agents it does not control: one of them may send a prompt of a
million tokens, ask for n=64 x 8k tokens, fire hundreds of calls at once or loop forever. Each
is bounded by a `GatewayConfig` setting and refused before the backend sees it:

- a prompt over `max_prompt_tokens`, or n x max_tokens over `max_generation_tokens`: 400, like
  any request that is too big; sent again unchanged it can never succeed.
- more than `max_concurrent_calls_per_rollout` calls of one attempt at once: 429. The official
  SDKs back off and retry a 429 by themselves, and a retry succeeds once a call finishes.
- a call past `max_calls_per_rollout` calls of one attempt: 429 too, as OpenAI answers a spent
  quota (the request is well formed; the attempt has used its budget), but with
  `x-should-retry: false`: the budget does not refill, so the SDKs raise RateLimitError at
  once instead of retrying. A retried rollout is a new attempt with a budget of its own.

Production episodes (calls on the plain routes kept under an episode id) count per episode as
calls do per attempt, with one exception: `max_calls_per_rollout` does not apply to them. An
episode is a user's session, which may rightly run to thousands of calls over days; the gateway
cannot tell it from a loop, and a 429 that is never retried would break that session for the
user, where in training it ends one rollout of many. The counters below also forget an idle
episode (the LRU), so a cap would be arbitrary for the long ones. The concurrency limit does
apply: it protects the server's capacity, and the clients retry it by themselves.

The per-attempt counters live in an LRU of at most `TRACKED_ATTEMPTS` entries: the gateway never
learns when an attempt ends, so the least recently used idle ones are dropped (a finished
attempt makes no more calls, so it ages out). An attempt idle for that many other attempts'
calls starts its count again, an error only in the agent's favour.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_core.errors import InvalidInput, RateLimited

# Characters one prompt token may stand for, in the pre-check that refuses a prompt before it is
# tokenized. SmolLM2's tokenizer, measured: 1.8-5 characters a token on prose, Python, JSON,
# Markdown and digits, 7.6 on deeply indented code; only runs of one character ("-" * n, spaces)
# reach its longest piece, 64-81. 16 leaves indented code twice its measure; a prompt of long
# runs past it is refused (shorter runs, or fewer of them, pass). At the default 32,768 tokens a
# prompt may have 512k characters, which the tokenizer takes ~0.7 s for (3.35 s for 2.5 MB).
CHARS_PER_TOKEN = 16
# 16k attempts at ~330 bytes each (measured: the two ids, counters, LRU links): about 5 MB at
# most, and far more attempts than run at once on one gateway.
TRACKED_ATTEMPTS = 16384


@dataclass(slots=True)
class _AttemptCalls:
    started: int = 0  # calls admitted so far
    running: int = 0  # calls admitted and not finished


class CallSlot:
    """One admitted call of an attempt; `release()` when it finishes (twice is harmless).
    `ended` is called on release too (the store's count of an episode's calls in flight)."""

    __slots__ = ("_calls", "_ended")

    def __init__(
        self, calls: _AttemptCalls | None, ended: Callable[[], None] | None = None
    ) -> None:
        self._calls = calls
        self._ended = ended

    def release(self) -> None:
        if self._calls is not None:
            self._calls.running -= 1
            self._calls = None
        if self._ended is not None:
            self._ended()
            self._ended = None


def chars_per_token(tokenizer: Any) -> int:
    """CHARS_PER_TOKEN, or the tokenizer's longest piece if shorter (81 for SmolLM2's): no
    token stands for more text than its own piece."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return min(CHARS_PER_TOKEN, max(len(p) for p in pieces if p))


class CallLimits:
    """The checks above, with the per-attempt counters they need."""

    def __init__(
        self,
        max_prompt_tokens: int,
        max_generation_tokens: int,
        max_concurrent_calls: int,
        max_calls: int,
        tracked: int = TRACKED_ATTEMPTS,
    ) -> None:
        self.max_prompt_tokens = max_prompt_tokens
        self.max_generation_tokens = max_generation_tokens
        self.max_concurrent_calls = max_concurrent_calls
        self.max_calls = max_calls
        self.tracked = tracked
        self._attempts: OrderedDict[tuple[str, str], _AttemptCalls] = OrderedDict()

    def check_text(self, chars: int, per_token: int) -> None:
        """400 for a prompt text too long to be under the limit, before it is tokenized (a
        64 MB prompt takes the tokenizer over a minute), counted at `per_token` characters a
        token (`chars_per_token`)."""
        if chars > self.max_prompt_tokens * per_token:
            self._prompt_too_long(
                f"{chars} characters (counted at {per_token} a token), so about "
                f"{chars // per_token}"
            )

    def check_size(self, prompt_tokens: int, n: int, max_tokens: int, prompts: int = 1) -> None:
        """400 for a prompt (all prompts of a batch together) or a generation over the limits."""
        if prompt_tokens > self.max_prompt_tokens:
            self._prompt_too_long(str(prompt_tokens))
        asked = prompts * n * max_tokens
        if asked > self.max_generation_tokens:
            batch = f"{prompts} prompts x " if prompts > 1 else ""
            raise InvalidInput(
                f"{batch}n={n} x max tokens {max_tokens} = {asked} tokens to generate, over "
                f"this gateway's limit of {self.max_generation_tokens}: lower n or the max "
                "tokens, or raise the server's max_generation_tokens "
                "(LIGHTNING_MAX_GENERATION_TOKENS)"
            )

    def _prompt_too_long(self, tokens: str) -> None:
        raise InvalidInput(
            f"the prompt is {tokens} tokens, over this gateway's limit of "
            f"{self.max_prompt_tokens}: shorten it (fewer or shorter messages), or raise the "
            "server's max_prompt_tokens (LIGHTNING_MAX_PROMPT_TOKENS)"
        )

    def admit(
        self,
        rollout_id: str | None,
        attempt_id: str | None,
        capped: bool = True,
        ended: Callable[[], None] | None = None,
    ) -> CallSlot:
        """Count one call of the attempt (none outside a rollout); 429 past its limits.
        `capped`: whether max_calls applies (not to production episodes, see above); `ended`
        goes with the slot (CallSlot), or is called at once when the call is refused."""
        try:
            return self._admit(rollout_id, attempt_id, capped, ended)
        except BaseException:
            if ended is not None:
                ended()
            raise

    def _admit(
        self,
        rollout_id: str | None,
        attempt_id: str | None,
        capped: bool,
        ended: Callable[[], None] | None,
    ) -> CallSlot:
        if rollout_id is None:
            return CallSlot(None, ended)
        key = (rollout_id, attempt_id or "")
        calls = self._attempts.get(key)
        if calls is None:
            calls = self._attempts[key] = _AttemptCalls()
            self._evict()
        else:
            self._attempts.move_to_end(key)
        if capped and calls.started >= self.max_calls:
            raise RateLimited(
                f"attempt {key[1]} of rollout {rollout_id} has made its {self.max_calls} LLM "
                "calls (max_calls_per_rollout): an agent that loops without end is stopped "
                "here. Let the agent finish in fewer calls, or raise the server's "
                "max_calls_per_rollout (LIGHTNING_MAX_CALLS_PER_ROLLOUT)",
                retry=False,
            )
        if calls.running >= self.max_concurrent_calls:
            raise RateLimited(
                f"attempt {key[1]} of rollout {rollout_id} already has {calls.running} calls "
                f"running, the limit (max_concurrent_calls_per_rollout): retry when one has "
                "finished (the OpenAI and Anthropic clients do so by themselves), or raise the "
                "server's LIGHTNING_MAX_CONCURRENT_CALLS_PER_ROLLOUT",
                retry=True,
            )
        calls.started += 1
        calls.running += 1
        return CallSlot(calls, ended)

    def tracked_attempts(self) -> int:
        return len(self._attempts)

    def _evict(self) -> None:
        # Oldest first; an attempt with calls running is kept (moved to the young end), so its
        # slots stay counted. At most one pass over those.
        for _ in range(len(self._attempts)):
            if len(self._attempts) <= self.tracked:
                return
            key, calls = next(iter(self._attempts.items()))
            if calls.running:
                self._attempts.move_to_end(key)
            else:
                del self._attempts[key]
