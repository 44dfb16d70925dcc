"""A short run of the abuse benchmark (benchmarks/abuse.py), so that it keeps working between
full runs: the good workload beside every hostile kind, for a few seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_abuse_run_meets_every_hostile_kind_without_a_good_failure():
    done = subprocess.run(
        [sys.executable, "benchmarks/abuse.py", "--seconds", "8", "--baseline", "3"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    assert "abuse_good_request_failures: 0" in text, text
    for kind in ("huge prompt", "huge OTLP body", "huge grammar", "disconnect mid-body"):
        assert f"| {kind} |" in text, (kind, text)
    # Each refused as itself: a 4xx, never a 500 or a dropped connection.
    assert "| huge prompt | 400 x" in text and "| huge OTLP body | 413 x" in text, text
    assert "500" not in text.split("| hostile kind |")[1].split("abuse_")[0], text
    for line in ("abuse_health_p99_ms: ", "abuse_good_p99_ms_without_hostile: "):
        assert line in text, text
