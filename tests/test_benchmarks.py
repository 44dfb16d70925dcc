"""Every benchmark's quick mode, run as its command line runs it: a change that breaks a
benchmark fails here, not on the benchmark's next full run, months later.

Each script in benchmarks/ takes `--quick` (its docstring says what that runs and which settings
it needs); soak, abuse, fuzz, gpu_check and fault_matrix have tests of their own, named in
ELSEWHERE. The quick modes that train (calc_gain, rag_heldout, overlap, ablation_sql) run a real
`lightning-rl train` on the tiny random model for a minute or two each, so they are slow tests.
Their figures are noise: what is checked is that each benchmark runs to its end and prints its
table and figure lines, with the values its own design guarantees.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Scripts whose short run is a test elsewhere; each file names its script.
ELSEWHERE = {
    "soak": "tests/test_soak.py",
    "abuse": "tests/test_abuse_bench.py",
    "abuse_training": "tests/test_abuse_bench.py",
    "fuzz": "tests/test_fuzz.py",
    "gpu_check": "tests/test_gpu_check.py",
    "fault_matrix": "tests/test_faults.py",
    "production_drift": "tests/test_production_drift.py",
    "learning_report": "tests/test_flow.py",
    "heldout_split": "tests/test_flow.py",
}
# Modules the scripts import, with nothing to run of their own.
HELPERS = {"workload", "quick_train", "abuse_agents"}
QUICK = (
    "gateway",
    "store_throughput",
    "store_scale",
    "structured",
    "train_step",
    "shared_prefix",
    "grammar_engines",
    "sql_greedy",
    "judge_agreement",
    "calc_gain",
    "rag_heldout",
    "sft_vs_rl",
    "overlap",
    "ablation_sql",
    "objectives",
    "offline_gate",
    "frozen_replay",
    "tiny_answerer",
)
FIGURE = re.compile(r"^(\w+): (-?[\d.]+|nan|n/a)\b", re.M)


def run_benchmark(name: str, *args: str, timeout: float, env: dict[str, str] | None = None) -> str:
    """`python -m benchmarks.NAME ARGS` from the repository root, with `env` added to this
    process's environment; its stdout, once it exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n" + (
        done.stdout[-3000:] + "\n--- stderr ---\n" + done.stderr[-3000:]
    )
    return done.stdout


def figures(text: str) -> dict[str, str]:
    return dict(FIGURE.findall(text))


def table_rows(text: str, first: str | None = None) -> list[list[str]]:
    """The cells of each markdown table row (whose first cell is `first`, if given)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and first in (None, cells[0]):
            rows.append(cells)
    return rows


def test_every_benchmark_script_has_a_quick_run_in_the_tests():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__"}
    assert scripts == set(QUICK) | set(ELSEWHERE) | HELPERS, (
        "a benchmark without a quick mode run by the tests (or a stale name here)"
    )
    for name in QUICK:
        assert f"test_{name}_quick" in globals(), name
        assert "--quick" in (ROOT / "benchmarks" / f"{name}.py").read_text(), name
    for name, test in ELSEWHERE.items():
        assert f"benchmarks/{name}.py" in (ROOT / test).read_text(), (name, test)


# ---------------------------------------------------------------------------- seconds each


@pytest.mark.timeout(300)
def test_gateway_quick():
    text = run_benchmark("gateway", "--quick", timeout=280)
    # Every route measured at both levels (a 429 from the per-rollout limits would have ended
    # the run: 32 clients and 1,203 calls on one attempt are over the gateway's defaults).
    for route in ("chat/completions", "responses", "messages"):
        rows = table_rows(text, f"gateway /v1/{route}")
        assert [r[1] for r in rows] == ["1", "32"], (route, text)
        assert all("n/a" not in " ".join(r) for r in rows), (route, text)
    assert float(figures(text)["gateway_overhead_p50_ms"]) > 0, text
    assert "gateway_added_vs_litellm" in figures(text), text
    speed = table_rows(text, "transformers")
    assert [r[1] for r in speed] == ["1", "32"], text
    # 16 new tokens a request: the tiny random model rarely samples its end of sequence.
    assert all(int(r[2]) > 0 and float(r[4]) > 0 for r in speed), text
    assert "quick: no vLLM column" in text


@pytest.mark.timeout(180)
def test_store_throughput_quick():
    # With a few production episodes stored first, as `--prefill 1000000` stores a year's.
    text = run_benchmark("store_throughput", "--quick", "--prefill", "500", timeout=170)
    [ours] = table_rows(text, "lightning-rl + 500 episodes")
    runners, rollouts, spans = int(ours[1]), int(ours[2]), int(ours[3])
    # Every rollout read back and checked; each has at least a round, a final span, a reward.
    assert (runners, rollouts) == (4, 32) and spans >= 4 * rollouts, text
    assert "ratio_vs_agentlightning" in text and "add_spans_p99_vs_agentlightning" in text


@pytest.mark.timeout(300)
def test_store_scale_quick():
    text = run_benchmark("store_scale", "--quick", timeout=280)
    rows = {r[0]: r[1] for r in table_rows(text)}
    assert rows["episodes stored"] == "2,000", text
    # A week is 2,000 // 52 = 38 episodes: the weekly plan takes the last 38, two calls each;
    # 90 days back from the year's end archives about 39 of the 52 weeks.
    assert "data=episodes plan, last week (38 episodes, 76 transitions)" in rows, text
    archived = [k for k in rows if k.startswith("archive (")]
    assert archived and int(archived[0].split()[1].strip("(").replace(",", "")) > 1000, text
    # The 3 weeks added later are archived in turn, about a week's 38 episodes each.
    weeks = [k for k in rows if k.startswith("week +")]
    assert len(weeks) == 3 and all("archived 3" in k for k in weeks), text
    assert set(figures(text)) >= {"plan_episodes_quick_s", "archive_s", "store_mb_after"}, text


@pytest.mark.timeout(180)
def test_structured_quick():
    text = run_benchmark("structured", "--quick", timeout=170)
    rows = {r[0]: r for r in table_rows(text, "free") + table_rows(text, "json_schema")}
    assert set(rows) == {"free", "json_schema"}, text
    # The schema cannot be satisfied in 16 tokens, so both modes decode all 2 x 16: the
    # like-for-like tokens/s the overhead figure compares.
    assert rows["free"][3] == rows["json_schema"][3] == "32", text
    assert rows["json_schema"][4] == "length", text
    assert "structured_overhead_pct" in figures(text), text


@pytest.mark.timeout(180)
def test_train_step_quick():
    text = run_benchmark("train_step", "--quick", timeout=170)
    [row] = table_rows(text, "4 x 64")
    assert float(row[2]) > 0, text  # tokens/s
    assert float(figures(text)["train_mfu"]) > 0, text
    # 2 episodes x 3 calls: merged, each episode is one forward over its last call.
    apart, merged = table_rows(text, "false"), table_rows(text, "true")
    assert int(merged[0][1]) < int(apart[0][1]), text
    assert 0 < float(figures(text)["prefix_merge_tokens_saved_frac"]) < 1, text


@pytest.mark.timeout(180)
def test_shared_prefix_quick():
    text = run_benchmark("shared_prefix", "--quick", timeout=170)
    [row] = table_rows(text, "1")
    # 4 tasks x a group of 4 over one system prompt: each group computes its prompt once.
    assert int(row[3]) < int(row[2]) / 2, text
    assert 0.5 < float(figures(text)["shared_prefix_tokens_saved_frac"]) < 1, text


@pytest.mark.timeout(180)
def test_offline_gate_quick():
    text = run_benchmark("offline_gate", "--quick", timeout=170)
    found = figures(text)
    # Same gap, same update either way; the time saved is a figure, not asserted (noise).
    assert float(found["behaviour_kl_abs_diff"]) < 1e-5, text
    assert float(found["max_abs_diff"]) < 1e-6, text
    assert len(table_rows(text, "gated update")) == 1, text


@pytest.mark.timeout(180)
def test_frozen_replay_quick():
    text = run_benchmark("frozen_replay", "--quick", timeout=170)
    # The same four updates either way; the time saved is a figure, not asserted (noise).
    assert float(figures(text)["max_abs_diff"]) < 1e-6, text
    assert [r[0] for r in table_rows(text)][2:] == ["1", "2", "3", "4", "all"], text


@pytest.mark.timeout(180)
def test_grammar_engines_quick():
    text = run_benchmark("grammar_engines", "--quick", timeout=170)
    rows = [r for r in table_rows(text) if r[0].startswith("tiny (") and r[1] == "llguidance"]
    assert [r[2] for r in rows] == ["json_object", "json_schema"], text
    for row in rows:
        ended, walks = map(int, row[-2].split("/"))
        valid, of = map(int, row[-1].split("/"))
        # 8 walks at batch 1 and one batch of 8; every walk that ended is valid JSON under the
        # grammar, or the engine let through a token it should have masked.
        assert walks == 16 and of == ended and valid == ended, row


@pytest.mark.timeout(300)
def test_sql_greedy_quick():
    text = run_benchmark("sql_greedy", "--quick", timeout=280)
    for arm in ("free", "grammar"):
        assert re.search(rf"^## {arm} \(2 questions, \d+ s\)$", text, re.M), text
    # Each arm sorts its 2 final queries into the outcome columns (right, rows but wrong, no
    # rows, failed): one row of counts per arm.
    outcomes = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", text, re.M)
    assert len(outcomes) == 2 and all(sum(map(int, o)) == 2 for o in outcomes), text


def test_judge_agreement_quick():
    text = run_benchmark("judge_agreement", "--quick", timeout=280)
    [row] = table_rows(text, "rank")
    # The tiny random model's 8 trajectories, judged in 2 group calls (one per task).
    assert row[2] == "8" and row[7] == "2", text
    assert float(figures(text)["judge_agreement_pct"]) >= 0, text


# ---------------------------------------------------------------------------- a training run each
# Their `lightning-rl train` runs inherit the benchmark's environment: with prefect_api_env
# they run on the tests' shared Prefect server instead of starting a temporary one each.


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_calc_gain_quick(prefect_api_env):
    text = run_benchmark("calc_gain", "--quick", timeout=400, env=prefect_api_env)
    assert re.search(r"^run calc-quick: 4 held-out tasks", text, re.M), text
    assert len(table_rows(text, "tiny-random-llama")) == 1, text
    assert len(table_rows(text, "calc-quick-v1")) == 1, text
    solved = re.search(r"^newly solved (\d+), lost (\d+), unchanged (\d+)$", text, re.M)
    assert solved and sum(map(int, solved.groups())) == 4, text
    assert "calc_heldout_gain_points" in figures(text), text


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_rag_heldout_quick(prefect_api_env):
    text = run_benchmark("rag_heldout", "--quick", timeout=400, env=prefect_api_env)
    [every] = table_rows(text, "all")
    assert every[1] == "4", text
    # The 4 held-out tasks, each in its hop count's row.
    tiers = [r for hops in ("1-hop", "2-hop", "3-hop") for r in table_rows(text, hops)]
    assert sum(int(r[1]) for r in tiers) == 4, text
    assert "rag_heldout_gain_points" in figures(text), text


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sft_vs_rl_quick(prefect_api_env):
    text = run_benchmark("sft_vs_rl", "--quick", timeout=400, env=prefect_api_env)
    # The base model from the RL-alone run, v0 and v1 from the warm-started one.
    assert re.search(
        r"base = tiny-random-llama, sft = sft-quick-v0, sft\+rl = sft-quick-v1, rl = rl-quick-v1",
        text,
    ), text
    [every] = table_rows(text, "all")
    assert every[1] == "4", text
    found = figures(text)
    assert {"calc_sft_then_rl_gain_points", "sft_then_rl_minus_rl_alone_points"} <= set(found)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_overlap_quick(prefect_api_env):
    text = run_benchmark("overlap", "--quick", timeout=580, env=prefect_api_env)
    s0, s1 = table_rows(text, "overlap-s0"), table_rows(text, "overlap-s1")
    assert len(s0) == len(s1) == 1 and (s0[0][1], s1[0][1]) == ("0", "1"), text
    # Staleness 0 never trains on rollouts of an older policy; staleness 1 at most one behind.
    assert float(s0[0][6]) == 0 and 0 <= float(s1[0][6]) <= 1, text
    found = figures(text)
    assert float(found["overlap_speedup"]) > 0 and float(found["iterations_speedup"]) > 0, text
    assert {"heldout_gain_points_staleness_0", "heldout_gain_points_staleness_1"} <= set(found)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ablation_sql_quick(prefect_api_env, tmp_path):
    text = run_benchmark(
        "ablation_sql", "--quick", "--run-dir", str(tmp_path), timeout=500, env=prefect_api_env
    )
    [row] = table_rows(text, "per-agent")
    assert float(row[-1]) > 0, text  # minutes
    # The same run read by sql_greedy's --run, which sorts each policy's held-out queries.
    text = run_benchmark("sql_greedy", "--run", str(tmp_path / "ablation-per-agent"), timeout=80)
    sections = re.findall(r"^## (\S+) \((\d+) questions\)$", text, re.M)
    assert sections == [
        ("tiny-random-llama", "4"),
        ("ablation-per-agent-v1", "4"),
    ], text


def test_every_objectives_arm_is_valid_settings():
    from benchmarks.objectives import ARMS
    from lightning_core.algo.config import TrainerConfig
    from lightning_core.data.collect import CreditConfig

    for arm, sections in ARMS.items():
        TrainerConfig(**sections.get("trainer", {}))
        CreditConfig(**sections.get("credit", {}))
        assert set(sections) <= {"trainer", "credit"}, arm


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_objectives_quick(prefect_api_env, tmp_path):
    text = run_benchmark(
        "objectives", "--quick", "--run-dir", str(tmp_path), timeout=580, env=prefect_api_env
    )
    rows = table_rows(text, "default") + table_rows(text, "gspo")
    assert len(rows) == 2 and all(float(r[-1]) > 0 for r in rows), text  # minutes
    assert "calc_minutes_to_20" in figures(text), text
    # Each arm ran with its own settings: GSPO's are in its run's config.
    config = (tmp_path / "objectives-gspo" / "config.json").read_text()
    assert '"importance_ratio": "sequence"' in config, config
    # A real run's calls, read from its store, for the shared-prefix benchmark: a calc group's
    # rollouts send one prompt, so the shared update computes fewer tokens.
    text = run_benchmark(
        "shared_prefix", str(tmp_path / "objectives-default"), "--every-call", timeout=170
    )
    [row] = table_rows(text, "1")
    assert int(row[1]) >= 4 and int(row[3]) < int(row[2]), text  # 2 tasks x 2 rollouts


@pytest.mark.timeout(300)
def test_tiny_answerer_quick():
    text = run_benchmark("tiny_answerer", "--quick", timeout=280)
    # One example set, answers agreeing then disagreeing with gold, by the current recipe.
    rows = [line.split() for line in text.splitlines() if line.startswith("new ")]
    assert [r[2:4] for r in rows[:2]] == [["agree", "True"], ["disagree", "True"]], text
    assert figures(text)["tiny_answerer_failures"] == "0", text
