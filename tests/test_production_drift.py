"""The drift demonstration (benchmarks/production_drift.py, `make demo-production`): its
settings and their one-line errors, the calc task generator's drift knob, and the quick mode run
end to end (slow): week 0 trains a champion, two real production servers (the loop's and a
frozen champion's) answer the same simulated users, a weekly retraining run on the episodes
goes through the offline gate. The tiny model learns nothing: what is checked is the table, the
figure lines, and that the registry's decisions agree with each other and with the table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.drift.settings import QUICK, DriftSettings
from lightning_rl.agents.calc.calculator import evaluate
from lightning_rl.agents.calc.data import fresh_tasks, load_tasks
from tests.test_benchmarks import FIGURE, table_rows
from tests.test_task_table import QUESTION

ROOT = Path(__file__).resolve().parents[1]


def test_drift_zero_keeps_the_fresh_stream_and_drift_one_is_all_drifted():
    assert fresh_tasks(60, seed=3, drift=0.0) == fresh_tasks(60, seed=3)
    drifted = fresh_tasks(60, seed=3, drift=1.0)
    assert {t["source"] for t in drifted} == {"arithmetic-drift"}
    for task in drifted:
        spoken = re.fullmatch(QUESTION, task["question"]).group(1)
        # In words only: the agent has to write the calculator's expression itself.
        assert not set("+-*/()") & set(spoken), task
        expression = spoken.replace("plus", "+").replace("minus", "-").replace("times", "*")
        assert task["answer"] == evaluate(expression), task
        numbers = [int(n) for n in re.findall(r"\d+", expression)]
        assert len(numbers) in (3, 4) and min(numbers) >= 100, task
    half = fresh_tasks(200, seed=3, drift=0.5)
    share = sum(t["source"] == "arithmetic-drift" for t in half) / len(half)
    assert 0.35 < share < 0.65, share
    test_split = {t["question"] for t in load_tasks("test", 1000)}
    assert not test_split & {t["question"] for t in drifted + half}
    with pytest.raises(ValueError, match="between 0 and 1"):
        fresh_tasks(5, seed=3, drift=1.5)


def test_the_fresh_command_takes_a_drift():
    done = subprocess.run(
        [sys.executable, "-m", "lightning_rl.agents.calc.fresh", "--fresh", "3", "--drift", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["source"] for line in done.stdout.splitlines()] == [
        "arithmetic-drift"
    ] * 3
    bad = subprocess.run(
        [sys.executable, "-m", "lightning_rl.agents.calc.fresh", "--fresh", "3", "--drift", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "--drift must be between 0 and 1, not 2.0" in bad.stderr


def test_drift_grows_linearly_over_the_weeks_and_bad_settings_say_why():
    settings = DriftSettings(weeks=4, drift_start=0.25, drift_end=1.0)
    assert [settings.drift(w) for w in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    assert DriftSettings(**QUICK).weeks == 2
    with pytest.raises(ValueError, match=r"drift_end .* is below drift_start"):
        DriftSettings(drift_start=0.8, drift_end=0.2)
    done = subprocess.run(
        [sys.executable, "benchmarks/production_drift.py", "--set", "missing_rate=2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "invalid drift setting: missing_rate: Input should be less than or equal to 1"
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_production_drift_quick(tmp_path, prefect_api_env):
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.production_drift", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
        env={**os.environ, **prefect_api_env},
    )
    text = done.stdout
    assert done.returncode == 0, text[-3000:] + done.stderr[-3000:]
    figures = dict(FIGURE.findall(text))
    assert "production_recovery_points" in figures and "promotion_to_serving_s" in figures, text
    rows = [r for r in table_rows(text) if r[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and [r[1] for r in rows] == ["50%", "100%"], text
    assert "registry consistent: yes" in text, text

    result = json.loads((out / "result.json").read_text())
    weeks = result["weeks"]
    assert [w["episodes"] for w in weeks] == [QUICK["episodes_per_week"]] * 2
    for w in weeks:
        f = w["feedback"]
        # Every answered episode's feedback is on time, late or missing (errors have none).
        assert f["on_time"] + f["late"] + f["missing"] == w["episodes"] - w["errors"], w
        assert w["gain_points"] == pytest.approx(100 * (w["loop"] - w["frozen"]), abs=0.1)
    assert float(figures["production_recovery_points"]) == weeks[-1]["gain_points"]
    # Week 1's retraining ran on its episodes and the offline gate decided on the pinned
    # benchmark; what it decided is what the registry holds.
    retrain = weeks[0]["retrain"]
    assert retrain != "skipped (nothing new)", retrain
    version = re.match(r"v(\d+) (promoted|canary|rejected)", retrain)
    assert version, retrain
    tags = result["versions"][version.group(1)]
    assert tags["eval.benchmark_id"] == result["pinned_benchmark"]
    if version.group(2) == "canary":
        assert f"v{version.group(1)} promotion.decision=canary" in weeks[0]["decisions"]
        # Served as the challenger in week 2, unless the live gate decided meanwhile.
        assert weeks[1]["challenger"] == version.group(1) or "live.decision" in tags
    assert weeks[-1]["retrain"] == "not run"
