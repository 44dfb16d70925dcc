"""The judge: asks an OpenAI-compatible endpoint for verdicts, within a budget, from a cache.

Calls go through the official `openai` client, which retries what fails on the wire (429s,
5xx, lost connections) `retries` times; an answer that cannot be read as a verdict is asked
again, up to `retries` more times, each ask counting against the budget. A judgement that
still fails says why and scores nothing: its rollouts are not trained on (data/collect.py).
The budget (`max_calls`, `max_tokens`) is checked before each call, counting the calls in
flight, so a run stops at it rather than past it, with a BudgetSpent error that says which
limit and what to raise.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import openai

from lightning_core import semconv
from lightning_core.errors import BudgetSpent
from lightning_core.judge import prompts
from lightning_core.judge.cache import JudgeCache, cache_key
from lightning_core.judge.config import JudgeConfig

Reader = Callable[[Any], list[float] | None]


@dataclass
class Judgement:
    """The judge's score of one trajectory (None when it failed, `error` saying why)."""

    score: float | None
    cached: bool = False
    error: str | None = None
    call_id: str | None = None


class Judge:
    """One run's judge on one endpoint."""

    def __init__(
        self,
        config: JudgeConfig,
        rubric: str,
        model: str,
        base_url: str,
        api_key: str | None,
        cache: JudgeCache,
    ) -> None:
        self.config, self.rubric, self.model, self.cache = config, rubric, model, cache
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "no-key",
            max_retries=config.retries,
            timeout=config.timeout_s,
            default_headers={semconv.AGENT_HEADER: semconv.JUDGE_AGENT},
        )
        self._slots = asyncio.Semaphore(config.concurrency)
        self._in_flight = 0

    async def close(self) -> None:
        await self._client.close()

    async def judge(self, task: str, transcripts: Sequence[str]) -> list[Judgement]:
        """Scores of one group's trajectories of the same task, in order."""
        if not transcripts:
            return []
        if self.config.mode == "rank":
            return await self._rank(task, list(transcripts))
        return list(await asyncio.gather(*(self._verdict(task, t) for t in transcripts)))

    async def _verdict(self, task: str, transcript: str) -> Judgement:
        request = {
            "messages": prompts.verdict_messages(self.rubric, task, transcript),
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": prompts.TOP_LOGPROBS,
        }

        def read(response: Any) -> list[float] | None:
            choice = response.choices[0]
            content = choice.logprobs.content if choice.logprobs else None
            top = [(t.token, t.logprob) for t in content[0].top_logprobs] if content else None
            score = prompts.verdict_score(top, choice.message.content)
            return None if score is None else [score]

        key = cache_key(self.model, "verdict", self.rubric, task, transcript)
        judged = await self._ask(key, request, read)
        return judged[0]

    async def _rank(self, task: str, transcripts: list[str]) -> list[Judgement]:
        n = len(transcripts)
        request = {
            "messages": prompts.rank_messages(self.rubric, task, transcripts),
            "max_tokens": prompts.rank_max_tokens(n),
            "response_format": prompts.rank_schema(n),
        }

        def read(response: Any) -> list[float] | None:
            return prompts.rank_scores(response.choices[0].message.content, n)

        key = cache_key(self.model, "rank", self.rubric, task, transcripts)
        judged = await self._ask(key, request, read, n)
        return judged

    def _reserve(self) -> None:
        spent = self.cache.spent()
        limits = self.config
        if limits.max_calls is not None and spent.calls + self._in_flight >= limits.max_calls:
            flying = f" and {self._in_flight} in flight" if self._in_flight else ""
            raise BudgetSpent(
                f"the judge's budget is spent: {spent.calls} calls made{flying} of "
                f"judge.max_calls={limits.max_calls} ({spent.tokens} tokens); raise "
                "judge.max_calls to go on (a rerun resumes from the last checkpoint)"
            )
        if limits.max_tokens is not None and spent.tokens >= limits.max_tokens:
            raise BudgetSpent(
                f"the judge's budget is spent: {spent.tokens} tokens of judge.max_tokens="
                f"{limits.max_tokens} ({spent.calls} calls); raise judge.max_tokens to go on "
                "(a rerun resumes from the last checkpoint)"
            )
        self._in_flight += 1

    async def _ask(
        self, key: str, request: dict[str, Any], read: Reader, n: int = 1
    ) -> list[Judgement]:
        cached = self.cache.get(key)
        if cached is not None:
            return [Judgement(score, cached=True) for score in cached]
        error = "no answer"
        for _ in range(self.config.retries + 1):
            call_id = uuid.uuid4().hex[:16]
            async with self._slots:
                self._reserve()
                try:
                    response = await self._client.chat.completions.create(
                        model=self.model, temperature=0.0, **request
                    )
                except openai.APIError as exc:
                    self.cache.charge(1, 0, failures=1)
                    return [Judgement(None, error=_api_error(exc), call_id=call_id)] * n
                finally:
                    self._in_flight -= 1
            usage = response.usage
            tokens = usage.prompt_tokens + usage.completion_tokens if usage else 0
            scores = _read(read, response)
            self.cache.charge(1, tokens, failures=int(scores is None))
            if scores is not None:
                self.cache.put(key, scores)
                return [Judgement(s, call_id=call_id) for s in scores]
            error = f"unreadable answer: {_text(response)[:200]!r}"
        return [Judgement(None, error=error)] * n


def _read(read: Reader, response: Any) -> list[float] | None:
    try:
        return read(response)
    except (AttributeError, IndexError, TypeError):
        return None  # an answer without the parts a verdict needs


def _text(response: Any) -> str:
    try:
        return str(response.choices[0].message.content or "")
    except (AttributeError, IndexError):
        return ""


def _api_error(exc: openai.APIError) -> str:
    status = getattr(exc, "status_code", None)
    return f"the judge endpoint failed ({status or type(exc).__name__}): {str(exc)[:300]}"
