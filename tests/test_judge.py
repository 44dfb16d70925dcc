"""Judge rewards (lightning_core/judge, docs/judge.md) with a real gateway serving the tiny model
as the judge, and another serving it as the policy: a group is ranked in one call, a repeat is
answered from the cache, the budget stops judging with a message that names the limit, the
judge's own calls are never trained on even when recorded on the rollout, and a judge whose
verdicts disagree with gold is refused. The judges that must agree (or disagree) with gold are
the tiny model trained in seconds to answer the calibration's own verdict prompts
(tests/models.py answering_model): a random model agrees with nothing on purpose."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from lightning_core import semconv
from lightning_core.app import create_app
from lightning_core.backends.transformers_backend import TransformersBackend
from lightning_core.data import analytics
from lightning_core.data.collect import collect
from lightning_core.errors import BudgetSpent, InvalidInput
from lightning_core.gateway.chat import encode, render_chat
from lightning_core.gateway.service import Gateway
from lightning_core.judge import prompts
from lightning_core.judge.cache import JudgeCache
from lightning_core.judge.calibration import calibrate, enforce
from lightning_core.judge.client import Judge
from lightning_core.judge.config import CalibrationConfig, JudgeConfig
from lightning_core.judge.groups import judge_rollouts
from lightning_core.judge.transcript import clip_middle, render, task_text
from lightning_core.store.client import HttpStoreClient
from lightning_core.store.duckdb_store import DuckDBStore
from lightning_core.types import RolloutRequest
from lightning_rl.judge_setup import JudgeSetup, api_key
from tests.conftest import ThreadedServer
from tests.models import answering_model, scaled_tiny_model

RUBRIC = "The reply names a colour."
QUESTIONS = ["Name a colour.", "Name a fruit.", "Name a city."]


def _serve(model_dir: Path):
    store = DuckDBStore(db=":memory:")
    backend = TransformersBackend(model=str(model_dir), device="cpu")
    server = ThreadedServer(create_app(store, gateway=Gateway(backend, store)))
    server.model = backend.base_model
    return server


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return scaled_tiny_model(tmp_path_factory.mktemp("tiny-policy"), 10)


@pytest.fixture(scope="module")
def policy(policy_dir):
    with _serve(policy_dir) as running:
        yield running


async def _group(server, question: str, rewards: list[float], group: str) -> list[str]:
    """A group of finished rollouts of one task: each attempt makes one sampled chat call
    through the gateway (recorded with its messages) and ends with its reward."""
    async with HttpStoreClient(server.url) as store:
        requests = [
            RolloutRequest(input={"id": group, "question": question}, task_id=group, group_id=group)
            for _ in rewards
        ]
        ids = [r.rollout_id for r in await store.enqueue_rollouts(requests)]
        for k, reward in enumerate(rewards):
            claim = await store.dequeue(f"w{k}")
            prefix = f"{server.url}/rollouts/{claim.rollout.rollout_id}/attempts"
            api = openai.AsyncOpenAI(
                base_url=f"{prefix}/{claim.attempt.attempt_id}/v1", api_key="-", max_retries=0
            )
            await api.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": question}],
                max_tokens=6,
                temperature=1.0,
                seed=k,
            )
            await api.close()
            await store.complete_attempt(claim.attempt.attempt_id, reward)
    return ids


async def _finished(server, ids: list[str]):
    async with HttpStoreClient(server.url) as store:
        return await store.query_rollouts(rollout_ids=ids), await store.query_spans(ids, "latest")


def _judge(server, config: JudgeConfig, cache: JudgeCache, base_url: str | None = None) -> Judge:
    return Judge(config, RUBRIC, server.model, base_url or f"{server.url}/v1", None, cache)


async def _judged(judge: Judge, server, ids: list[str]):
    rollouts, spans = await _finished(server, ids)
    try:
        return await judge_rollouts(judge, ["question"], rollouts, spans)
    finally:
        await judge.close()


def test_a_group_is_ranked_in_one_call_and_a_repeat_is_answered_by_the_cache(policy, tmp_path):
    ids = asyncio.run(_group(policy, QUESTIONS[0], [1.0, 0.0, 1.0, 0.0], "rank-1"))
    config = JudgeConfig(endpoint="server", mode="rank")
    cache = JudgeCache(tmp_path / "judge.sqlite")
    judged, spans = asyncio.run(_judged(_judge(policy, config, cache), policy, ids))
    # Four scores on the 0-10 scale, from one call: the schema held the random model to it.
    assert sorted(judged.scores) == sorted(ids) and not judged.failed
    assert all(0.0 <= s <= 1.0 and (10 * s).is_integer() for s in judged.scores.values())
    assert {s.attributes["gen_ai.response.id"] for s in spans} == {
        spans[0].attributes["gen_ai.response.id"]
    }
    first = cache.spent()
    assert (first.calls, first.hits) == (1, 0) and first.tokens > 100
    # The combined reward is the declared rule: the agent's own plus the judge's.
    rollouts, _ = asyncio.run(_finished(policy, ids))
    for rollout in rollouts:
        expected = rollout.episode_return + judged.scores[rollout.rollout_id]
        assert judged.finals[rollout.rollout_id] == pytest.approx(expected)

    # The same group again (a resumed iteration): no call, the same scores, spans say so.
    cache.close()
    reopened = JudgeCache(tmp_path / "judge.sqlite")
    again, spans = asyncio.run(_judged(_judge(policy, config, reopened), policy, ids))
    assert again.scores == judged.scores
    assert reopened.spent().calls == 1 and reopened.spent().hits == 1
    assert all(s.attributes[semconv.JUDGE_CACHED] for s in spans)


def test_the_budget_stops_judging_with_a_message_that_names_the_limit(policy):
    ids = asyncio.run(_group(policy, QUESTIONS[1], [1.0, 0.0, 0.0, 1.0], "budget-1"))
    cache = JudgeCache()
    config = JudgeConfig(endpoint="server", mode="verdict", max_calls=2, concurrency=1)
    with pytest.raises(BudgetSpent, match=r"2 calls made of judge.max_calls=2.*raise"):
        asyncio.run(_judged(_judge(policy, config, cache), policy, ids))
    assert cache.spent().calls == 2  # stopped at the limit, not past it
    tokens = JudgeConfig(endpoint="server", mode="rank", max_tokens=1)
    cache.charge(0, 1)
    with pytest.raises(BudgetSpent, match=r"judge.max_tokens=1"):
        asyncio.run(_judged(_judge(policy, tokens, cache), policy, ids))


def test_the_judges_calls_are_never_trained_on_even_when_recorded_on_the_rollout(policy):
    ids = asyncio.run(_group(policy, QUESTIONS[2], [0.0, 1.0], "spans-1"))
    rollouts, spans = asyncio.run(_finished(policy, ids))
    attempt = spans[0].attempt_id
    # The worst case: a judge pointed at the rollout's own prefix, so the gateway records its
    # call, token ids and all, among the agent's spans.
    on_rollout = f"{policy.url}/rollouts/{spans[0].rollout_id}/attempts/{attempt}/v1"
    config = JudgeConfig(endpoint="server", mode="rank", rule_weight=0.0)
    cache = JudgeCache()
    judge = _judge(policy, config, cache, on_rollout)
    judged, recorded = asyncio.run(_judged(judge, policy, ids))
    asyncio.run(_store_spans(policy, recorded))
    # A collect task retried after it stored them judges again (the cache answers) and stores
    # the judge's spans again: the same ids, so they are read back once.
    again, repeated = asyncio.run(_judged(_judge(policy, config, cache), policy, ids))
    assert again.scores == judged.scores and cache.spent().hits == 1
    assert sorted(s.span_id for s in repeated) == sorted(s.span_id for s in recorded)
    asyncio.run(_store_spans(policy, repeated))
    rollouts, spans = asyncio.run(_finished(policy, ids))
    judge_calls = [s for s in spans if s.attributes.get(semconv.AGENT_NAME) == "lightning-judge"]
    assert len(judge_calls) == 1 and semconv.PROMPT_TOKEN_IDS in judge_calls[0].attributes
    assert len([s for s in spans if s.name == semconv.JUDGE_SPAN]) == 2
    collected = collect(rollouts, spans, judged=judged)
    # One transition per agent call, none of the judge's; the final reward is the judge's
    # alone (rule_weight 0), and the facts carry its score.
    assert len(collected.transitions) == 2
    assert {t.agent_name for t in collected.transitions} == {None}
    for t in collected.transitions:
        assert t.reward == pytest.approx(judged.scores[t.rollout_id])
        assert collected.facts[t.rollout_id].judge_score == judged.scores[t.rollout_id]
    rows = analytics.transition_rows(collected.transitions, collected.facts)
    assert {r["judge_score"] for r in rows} == set(judged.scores.values())


async def _store_spans(server, spans) -> None:
    async with HttpStoreClient(server.url) as store:
        await store.add_spans(spans)


def test_a_judge_that_cannot_be_read_fails_its_rollouts_only(policy):
    ids = asyncio.run(_group(policy, QUESTIONS[0], [1.0, 0.0], "unread-1"))
    # A random model's one-token verdict is rarely "yes" or "no": unreadable, retried, then
    # the rollouts are not trained on (the rest of the iteration goes on).
    config = JudgeConfig(endpoint="server", mode="verdict", retries=1)
    cache = JudgeCache()
    judged, spans = asyncio.run(_judged(_judge(policy, config, cache), policy, ids))
    rollouts, agent_spans = asyncio.run(_finished(policy, ids))
    unread = judged.failed
    assert unread | set(judged.scores) == set(ids)
    for span in spans:
        if span.rollout_id in unread:
            assert "unreadable answer" in span.attributes[semconv.JUDGE_ERROR]
    collected = collect(rollouts, agent_spans, judged=judged)
    assert collected.refused["judge_failed"] == len(unread)
    assert {t.rollout_id for t in collected.transitions} == set(judged.scores)


# --- calibration against gold, with judges trained to agree or to disagree ----------------


@pytest.fixture(scope="module")
def labelled(policy):
    """Two groups of finished rollouts with gold rewards, and the spans of their calls."""
    ids = asyncio.run(_group(policy, QUESTIONS[0], [1.0, 0.0, 1.0, 0.0], "gold-1"))
    ids += asyncio.run(_group(policy, QUESTIONS[1], [0.0, 1.0, 0.0, 1.0], "gold-2"))
    return asyncio.run(_finished(policy, ids))


def _verdict_judge(policy_dir: Path, labelled, agree: bool) -> Path:
    rollouts, spans = labelled
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    examples = []
    for rollout in rollouts:
        mine = [s for s in spans if s.rollout_id == rollout.rollout_id]
        transcript = render(mine, JudgeConfig().max_transcript_chars)
        messages = prompts.verdict_messages(
            RUBRIC, task_text(rollout.input, ["question"]), transcript
        )
        right = rollout.episode_return >= 1.0
        examples.append(
            (encode(tokenizer, render_chat(tokenizer, messages)), "yes" if right == agree else "no")
        )
    return answering_model(examples)


@pytest.mark.parametrize("agree", [True, False], ids=["agreeing", "disagreeing"])
def test_calibration_measures_a_judge_against_gold_and_refuses_one_below_the_bar(
    policy, policy_dir, labelled, agree, tmp_path
):
    rollouts, spans = labelled
    with _serve(_verdict_judge(policy_dir, labelled, agree)) as judge_server:
        config = JudgeConfig(endpoint="http://127.0.0.1/v1", model="x", mode="verdict")
        judge = Judge(
            config, RUBRIC, judge_server.model, f"{judge_server.url}/v1", None, JudgeCache()
        )

        async def run():
            try:
                return await judge_rollouts(judge, ["question"], rollouts, spans)
            finally:
                await judge.close()

        judged, _ = asyncio.run(run())
    gold = {r.rollout_id: r.episode_return for r in rollouts}
    result = calibrate([judged.scores[r] for r in gold], list(gold.values()), gold_threshold=1.0)
    assert result.n == 8 and result.gold_positive_pct == 50.0
    bar = CalibrationConfig(min_agreement_pct=70.0)
    if agree:
        assert result.agreement_pct == 100.0 and result.spearman > 0.8
        assert enforce(result, bar, "tiny") is None
        return
    assert result.agreement_pct == 0.0 and result.spearman < -0.8
    with pytest.raises(InvalidInput, match=r"agrees with gold on 0.0 % of 8 .*allow_below"):
        enforce(result, bar, "tiny")
    allowed = bar.model_copy(update={"allow_below": True})
    assert "training with it anyway" in enforce(result, allowed, "tiny")


def test_the_combination_rule_and_the_config_are_checked():
    config = JudgeConfig(endpoint="server", rule_weight=0.5, judge_weight=2.0, gate=0.1)
    assert config.combine(1.0, 0.5) == pytest.approx(1.5)
    assert config.combine(0.0, 1.0) == 0.0  # below the gate: the judge does not count
    with pytest.raises(ValueError, match="'server' or an http"):
        JudgeConfig(endpoint="ftp://x")
    with pytest.raises(ValueError, match=r"needs judge\.model"):
        JudgeConfig(endpoint="https://api.example.com/v1")
    with pytest.raises(ValueError):
        JudgeConfig(endpoint="server", api_key_env="not a name")
    assert not JudgeConfig().enabled


def test_the_endpoints_key_comes_from_the_variable_the_config_names(monkeypatch, tmp_path):
    config = JudgeConfig(endpoint="https://judge.example/v1", model="m", api_key_env="JUDGE_KEY")
    setup = JudgeSetup(
        config=config, rubric="r", task_fields=["q"], model="m", base_url=config.endpoint,
        cache_path=str(tmp_path / "c.sqlite"),
    )  # fmt: skip
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(InvalidInput, match="JUDGE_KEY, which is not set"):
        api_key(setup)
    monkeypatch.setenv("JUDGE_KEY", "sk-secret")
    assert api_key(setup) == "sk-secret"
    assert "sk-secret" not in setup.model_dump_json()


def test_verdicts_and_ranks_are_read_strictly():
    assert prompts.verdict_score([(" Yes", -0.1), ("No", -2.3)], None) == pytest.approx(
        0.9048 / (0.9048 + 0.1003), abs=1e-3
    )
    assert prompts.verdict_score([("maybe", 0.0)], "no, it does not") == 0.0
    assert prompts.verdict_score(None, "perhaps") is None
    assert prompts.rank_scores('{"scores": [10, 0, 5]}', 3) == [1.0, 0.0, 0.5]
    assert prompts.rank_scores('{"scores": [10, 0]}', 3) is None
    assert prompts.rank_scores('{"scores": [11, 0, 5]}', 3) is None
    assert prompts.rank_scores('{"scores": [true, 0, 5]}', 3) is None
    assert prompts.rank_scores("ten", 3) is None
    clipped = clip_middle("a" * 100 + "ANSWER: x", 60)
    assert len(clipped) <= 60 and clipped.endswith("ANSWER: x")


def test_calibration_statistics():
    result = calibrate([0.9, 0.2, 0.6, 0.1], [1.0, 0.0, 0.0, 0.0], gold_threshold=0.9)
    assert result.agreement_pct == 75.0 and result.judge_positive_pct == 50.0
    assert result.spearman == pytest.approx(0.7746, abs=1e-3)
    assert calibrate([0.5, 0.5], [1.0, 0.0], 0.9).spearman is None
    with pytest.raises(ValueError):
        calibrate([], [], 0.9)


def test_the_gateway_refuses_nothing_a_judge_needs(policy):
    # The rank schema (enum items, exact array length) compiles on the gateway's grammar.
    reply = httpx.post(
        f"{policy.url}/v1/chat/completions",
        json={
            "model": policy.model,
            "messages": prompts.rank_messages(RUBRIC, "q", ["a", "b"]),
            "max_tokens": prompts.rank_max_tokens(2),
            "response_format": prompts.rank_schema(2),
            "temperature": 0,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert prompts.rank_scores(reply.json()["choices"][0]["message"]["content"], 2) is not None
