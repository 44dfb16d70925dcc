"""The calc agent: its calculator, tasks and reward, and the AutoGen agent end to end against
the gateway (SmolLM2, line tool format) under the real Runner."""

from __future__ import annotations

import pytest

from lightning_core import semconv
from lightning_core.algo.rewards import AIRRule
from lightning_core.data.adapter import AdapterConfig, spans_to_transitions
from lightning_core.models import DEFAULT_MODEL
from lightning_core.rollouts.runner import Runner, RunnerConfig
from lightning_core.store.client import HttpStoreClient
from lightning_core.types import RolloutRequest, RolloutStatus
from lightning_rl.agents.calc import load_tasks
from lightning_rl.agents.calc.calculator import CalculatorError, evaluate, format_number
from lightning_rl.agents.calc.reward import answer_reward, extract_answer
from tests.conftest import gateway_server

# --- calculator -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("3 * (4 + 5)", "27"),
        ("2^10", "1024"),
        ("1,000 + 5", "1005"),
        ("-(20 + 67 + -59)", "-28"),
        ("85 / 17", "5"),
        ("7 / 3", "2.333333"),
        ("12 × 3 ÷ 4", "9"),
        ("17 // 5 + 17 % 5", "5"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert format_number(evaluate(expression)) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "not a Call"),
        ("x + 1", "the name 'x'"),
        ("(1).real", "Attribute"),
        ("9 ** 9 ** 9", "exponents above"),
        ("10 ** 60 * 10 ** 60", "too large"),
        ("1 / 0", "division by zero"),
        ("64 / 8 = 8", "not an arithmetic expression"),
        ("", "empty"),
        ("1 + " * 80 + "1", "longer than"),
        ("-" * 40 + "1", "nested"),
    ],
)
def test_calculator_refuses_anything_else(expression, why):
    with pytest.raises(CalculatorError, match=why.replace("(", r"\(")):
        evaluate(expression)


def test_a_lone_number_is_no_calculation_for_the_tool():
    assert evaluate("27") == 27
    with pytest.raises(CalculatorError, match="nothing to calculate"):
        evaluate("-27", require_operation=True)


# --- tasks and reward -------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["arithmetic", "basic_arithmetic", "gsm_symbolic"])
def test_tasks_are_fixed_verified_and_splits_disjoint(source):
    train, test = load_tasks("train", 150, source), load_tasks("test", 100, source)
    assert len(train) == 150 and len(test) == 100
    assert load_tasks("test", 100, source) == test  # fixed seeds
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert len({t["id"] for t in train + test}) == 250
    if source != "gsm_symbolic":
        # Gold answers agree with the calculator on the question's own expression.
        for task in train[:50] + test[:50]:
            expression = task["question"].split(" ", 1)[1].rstrip("?.")
            for prefix in ("is the value of ", "is "):
                expression = expression.removeprefix(prefix)
            assert evaluate(expression) == pytest.approx(task["answer"]), task


def test_task_loader_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        load_tasks("dev", 10)
    with pytest.raises(ValueError, match="source"):
        load_tasks("train", 10, "algebra")


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("ANSWER: 42", 42.0),
        ("The result is 41.\nANSWER: -1,234.5", -1234.5),
        ("answer: 7 then ANSWER: 8", 8.0),
        ("42", None),
        ("", None),
        (None, None),
        ("ANSWER: forty-two", None),
    ],
)
def test_answer_extraction(text, answer):
    assert extract_answer(text) == answer


def test_reward_is_one_only_for_the_right_answer():
    assert answer_reward("ANSWER: 2.333333", 7 / 3) == 1.0
    assert answer_reward("ANSWER: 2.3", 7 / 3) == 0.0
    assert answer_reward("I think 27", 27) == 0.0  # no ANSWER marker, no answer


# --- the agent through the gateway ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_server():
    with gateway_server(tool_format="line") as running:
        yield running


async def test_calc_agent_runs_through_the_gateway_with_its_tool(smollm2_server):
    """Greedy SmolLM2 on the worked example's twin: a calculator call in the line format comes
    back to AutoGen as a tool call, the tool runs, the answer is scored; every LLM call is a
    transition of agent 'calc' with exact token ids, and AIR credits the tool call."""
    from lightning_rl.agents.calc import agent

    url = smollm2_server.url
    tasks = [
        {"id": "a", "question": "What is 6 * (2 + 5)?", "answer": 42},
        {"id": "b", "question": "What is 12 + 30?", "answer": 42},
    ]
    async with HttpStoreClient(url) as store:
        queued = await store.enqueue_rollouts(
            [
                RolloutRequest(input=t, task_id=t["id"], metadata={"sampling": {"temperature": 0}})
                for t in tasks
            ]
        )
        ids = [r.rollout_id for r in queued]
        runner = Runner(agent, store, url, RunnerConfig(concurrency=2, default_model=DEFAULT_MODEL))
        done = await runner.run_until_done(ids, timeout=180)
        assert [r.status for r in done] == [RolloutStatus.succeeded] * 2
        spans = await store.query_spans(ids, "latest")
    rule = AIRRule(name=semconv.TOOL_SPAN, outcome="success", reward=0.1)
    for rollout in done:
        mine = [s for s in spans if s.rollout_id == rollout.rollout_id]
        tools = [s for s in mine if s.name == semconv.TOOL_SPAN]
        calls = [s for s in mine if semconv.PROMPT_TOKEN_IDS in s.attributes]
        assert tools, "the agent never used its calculator"
        assert len(calls) >= 2  # the tool call, then the answer after its result
        transitions = spans_to_transitions(mine, rollout, AdapterConfig(air=[rule]))
        assert [t.agent_name for t in transitions] == ["calc"] * len(calls)
        final_text = calls[-1].attributes["gen_ai.output.messages"]
        expected = answer_reward(final_text.replace('\\"', '"'), 42)
        assert rollout.episode_return == expected
        tool_bonus = 0.1 * sum(1 for s in tools if s.attributes[semconv.TOOL_SUCCESS])
        assert sum(t.reward for t in transitions) == pytest.approx(expected + tool_bonus)
