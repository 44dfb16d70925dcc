"""The training part of the abuse benchmark: a real `lightning-rl train` run whose agents attack.

The run trains the tiny random model for 2 iterations of 12 tasks x 2 rollouts with the agents
of benchmarks/abuse_agents.py: of every 6 tasks, one is honest and five attack the run with
their own agent key (a reward span of 1e200, a returned reward of 1e200, a forged LLM-call span,
a call naming another model, a flood of 4,000-span requests). Its policy server has a key, as
every training run's does. The run must finish (`training_run_stopped_by_agent: 0`), train on
no forged call, and count what it refused.

    .venv/bin/python benchmarks/abuse_training.py      # alone (abuse.py runs it too)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.abuse_agents import ATTACK_LOG_ENV  # noqa: E402
from benchmarks.quick_train import QUICK_FLAGS, run_env, train_command  # noqa: E402
from benchmarks.results import record_printed  # noqa: E402

FLAGS = (
    *QUICK_FLAGS,
    *("--iterations", "2"),
    *("--tasks-per-iteration", "12"),
    *("--group-size", "2"),
)
# The forged call's made-up prompt and response (benchmarks/abuse_agents.py).
FORGED_PROMPT, FORGED_RESPONSE = [1, 2, 3], [4, 5, 6]


@dataclass
class TrainingAbuse:
    stopped: bool
    seconds: float
    answers: dict[str, Counter] = field(default_factory=dict)
    forged_transitions: int = 0
    transitions: int = 0
    log_tail: str = ""


def _transitions(run: Path) -> tuple[int, int]:
    """All transitions the run stored, and those made of the forged call's tokens."""
    total = forged = 0
    for path in sorted(run.rglob("*.duckdb")):
        with duckdb.connect(str(path), read_only=True) as db:
            tables = {r[0] for r in db.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
            if "transitions" not in tables:
                continue
            n, bad = db.execute(
                "SELECT count(*), count(*) FILTER (WHERE prompt_token_ids = ? "
                "AND response_token_ids = ?) FROM transitions",
                [FORGED_PROMPT, FORGED_RESPONSE],
            ).fetchone()
        total, forged = total + n, forged + bad
    return total, forged


def hostile_training(folder: Path) -> TrainingAbuse:
    """One training run with the hostile agents, in `folder`."""
    home, attacks = folder / "abuse.state", folder / "attacks.jsonl"
    env = run_env(home, **{ATTACK_LOG_ENV: str(attacks)})
    env["PYTHONPATH"] = str(ROOT)
    command = train_command(
        *("--agent", "benchmarks.abuse_agents:agent"),
        *("--tasks", "benchmarks.abuse_agents:load_tasks"),
        *("--run-dir", str(folder / "runs"), "--run-name", "abuse"),
        *FLAGS,
    )
    log = home / "train.log"
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    result = TrainingAbuse(stopped=done.returncode != 0, seconds=time.perf_counter() - start)
    if attacks.exists():
        for line in attacks.read_text().splitlines():
            entry = json.loads(line)
            result.answers.setdefault(entry["attack"], Counter())[str(entry["answer"])] += 1
    run = folder / "runs" / "abuse"
    if run.exists():
        result.transitions, result.forged_transitions = _transitions(run)
    if result.stopped:
        result.log_tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    return result


def report(result: TrainingAbuse) -> list[str]:
    lines = [
        "training run with hostile agents (tiny model, 2 iterations of 12 tasks x 2 rollouts): "
        f"{'stopped' if result.stopped else 'finished'} in {result.seconds:.0f} s, "
        f"{result.transitions} transitions stored, {result.forged_transitions} of them forged",
        "",
        "| attack | answers |",
        "|---|---|",
    ]
    for attack, answers in sorted(result.answers.items()):
        cells = ", ".join(f"{k} x{n}" for k, n in answers.most_common())
        lines.append(f"| {attack} | {cells} |")
    lines += [
        "",
        f"training_run_stopped_by_agent: {int(result.stopped)}",
        f"training_forged_transitions: {result.forged_transitions}",
    ]
    if result.log_tail:
        lines += ["", "the run's log ends:", result.log_tail]
    return lines


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="lightning-abuse-train-") as tmp:
        result = hostile_training(Path(tmp))
    text = "\n".join(report(result))
    print(text)
    record_printed(text, "training_")
    return 1 if result.stopped or result.forged_transitions else 0


if __name__ == "__main__":
    sys.exit(main())
