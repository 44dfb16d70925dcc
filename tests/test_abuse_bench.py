"""A short run of the abuse benchmark (benchmarks/abuse.py), so that it keeps working between
full runs: the good workload beside every hostile kind, for a few seconds, then the training
run whose agents attack it (benchmarks/abuse_training.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_short_abuse_run_meets_every_hostile_kind_without_a_good_failure():
    done = subprocess.run(
        [sys.executable, "benchmarks/abuse.py", "--seconds", "8", "--baseline", "3"],
        capture_output=True,
        text=True,
        timeout=460,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    assert "abuse_good_request_failures: 0" in text, text
    for kind in ("huge prompt", "huge OTLP body", "huge grammar", "disconnect mid-body"):
        assert f"| {kind} |" in text, (kind, text)
    # Each refused as itself: a 4xx, never a 500 or a dropped connection.
    assert "| huge prompt | 400 x" in text and "| huge OTLP body | 413 x" in text, text
    assert not _server_errors(text), (_server_errors(text), text)
    for line in ("abuse_health_p99_ms: ", "abuse_good_p99_ms_without_hostile: "):
        assert line in text, text
    # Issue 43's kinds: values out of range refused and routing still answering, the
    # quotas reached, and the training run finished on none of its agents' forgeries.
    assert "| reward out of range | 400 x" in text, text
    assert "| feedback out of range (and /serving/routing) | 400/200 x" in text, text
    assert re.search(r"\| feedback sources \|.*429 x", text), text
    assert re.search(r"\| span flood \|.*413 x", text), text
    assert "training_run_stopped_by_agent: 0" in text and "training_forged_transitions: 0" in text
    for attack in ("forged_call", "huge_reward"):
        row = re.search(rf"\| {attack} \| (.*) \|", text)
        assert row and set(re.findall(r"(\S+) x\d+", row.group(1))) == {"400"}, (attack, text)


def _server_errors(text: str) -> list[str]:
    """The answers of the hostile-kind table that are a 5xx status. Each cell reads
    'label xN, label xN'; a label is a status ('400', '400/400') or a word ('opened'), and
    the counts ('x500') are not statuses."""
    table = text.split("| hostile kind |")[1].split("abuse_")[0]
    bad = []
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 2:
            continue
        for answer in cells[1].split(", "):
            label = answer.rsplit(" x", 1)[0]
            if any(re.fullmatch(r"5\d\d", part) for part in label.split("/")):
                bad.append(f"{cells[0]}: {answer}")
    return bad


def test_server_errors_are_told_from_counts():
    table = (
        "| hostile kind | answers |\n|---|---|\n| idle connection | opened x500 |\n"
        "| huge grammar | 400/400 x31 |\n\nabuse_x: 1"
    )
    assert _server_errors(table) == []
    assert _server_errors(table.replace("400/400 x31", "400/500 x3, 200 x1")) == [
        "huge grammar: 400/500 x3"
    ]
