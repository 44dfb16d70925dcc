"""The drift demonstration (`make demo-production`): users drift toward questions the week-0
champion solves rarely, and the weekly loop (retraining on production episodes, offline gate,
canary, live gate) recovers; a frozen week-0 champion answers the same questions beside it.

    .venv/bin/python benchmarks/production_drift.py [--out runs/demo-production] [--set K=V ...]
    .venv/bin/python benchmarks/production_drift.py --quick   # tiny model, 2 weeks, a minute or two

Week 0 trains and registers the champion (`lightning-rl train --agent calc`, the pinned benchmark
is its held-out split). Two `lightning-rl production` servers start: the loop's, following the
registry (canary and live gate on), and the frozen champion's (`--policy <week-0 version>`).
Each week, simulated users (benchmarks/drift/users.py) ask both the same new questions, a
growing share of them drifted (agents/calc/data.py, `fresh_tasks(drift=...)`), and send the
loop's server partly missing, partly wrong and late feedback; then the weekly retraining run
(the `train/calc-production` deployment's parameters: data=episodes, warm start from the
challenger in canary (else the champion), the offline gate on the pinned benchmark, then the
live gate through a canary) trains on what is new. Printed: the per-week table, the registry's
decisions, and the figure lines `production_recovery_points` (loop minus frozen champion in
the last week, paired bootstrap interval) and `promotion_to_serving_s`; all of it also in
<out>/result.json. Settings: benchmarks/drift/settings.py (`--set weeks=3`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from benchmarks.drift.clock import PromotionClock  # noqa: E402
from benchmarks.drift.registry import changes, problems, versions  # noqa: E402
from benchmarks.drift.settings import QUICK, DriftSettings  # noqa: E402
from benchmarks.drift.users import Server, Week, run_week, send_late  # noqa: E402
from benchmarks.quick_train import run_env, run_logged, train_command  # noqa: E402
from benchmarks.results import record  # noqa: E402
from lightning_core.errors import LightningError  # noqa: E402
from lightning_core.serving.process import wait_healthy  # noqa: E402
from lightning_core.stats.comparison import paired_bootstrap  # noqa: E402
from lightning_core.stats.evaluation import wilson_interval  # noqa: E402
from lightning_rl.agents.calc.data import fresh_tasks  # noqa: E402
from lightning_rl.registry.config import RegistryConfig  # noqa: E402
from lightning_rl.registry.live import aliases  # noqa: E402
from lightning_rl.registry.names import TAG_SCORE  # noqa: E402

REGISTERED_MODEL = "drift-calc"
DEFAULT_OUT = Path("runs/demo-production")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Demo:
    """One demonstration's folder, registry, servers and weekly runs."""

    def __init__(self, out: Path, settings: DriftSettings) -> None:
        self.out, self.settings = out, settings
        self.env = run_env(out / "state")
        self.registry = RegistryConfig(
            tracking_uri=self.env["MLFLOW_TRACKING_URI"],
            registered_model=REGISTERED_MODEL,
            # No regression on the pinned benchmark: a version that scores at least the
            # champion's goes on to the canary, whose live gate is the one that must see a gain.
            promotion_margin=0.0,
        )

    # --- training ------------------------------------------------------------------------------

    def train(self, name: str, config: dict[str, Any]) -> dict[str, Any] | None:
        """A `lightning-rl train` run; its summary, or None when it trained nothing (skipped)."""
        s = self.settings
        base = {
            "agent": "calc",
            "run_dir": str(self.out / "runs"),
            "run_name": name,
            "server": {"model": s.model},
            "evaluation": {"eval_size": s.eval_size},
            "registry": self.registry.model_dump(mode="json"),
        }
        path = self.out / "state" / f"{name}.json"
        path.write_text(json.dumps(_merge(base, config), indent=1))
        started = time.monotonic()
        # A run takes minutes and logs to its file: say where, so the wait is not silent.
        log = self.out / "state" / f"{name}.log"
        print(f"{name}: training (log: {log}, progress: {self.out / 'runs' / name})", flush=True)
        command = train_command("--config", str(path), "--quiet")
        run_logged(command, self.env, log, f"training run {name}")
        summary = self.out / "runs" / name / "summary.json"
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
        return json.loads(summary.read_text()) if summary.exists() else None

    def week0(self) -> dict[str, Any]:
        s = self.settings
        summary = self.train(
            "week0",
            {
                "iterations": s.week0_iterations,
                "rollouts": {"tasks_per_iteration": s.week0_tasks, "group_size": s.group_size},
                "evaluation": {"eval_every": s.week0_iterations},
                "registry": {"live_gate": False},
            },
        )
        if summary is None or not summary["promotion"]["promote"]:
            sys.exit(f"week 0 registered no champion: {summary and summary['promotion']}")
        return summary

    def retrain(self, week: int, loop: Server, key_file: Path, pinned: str) -> str:
        """The weekly run on the loop server's new episodes; its offline gate's decision."""
        s = self.settings
        summary = self.train(
            f"week{week}",
            {
                "iterations": s.retrain_iterations,
                "warm_start": s.warm_start,
                "data": {
                    "source": "episodes",
                    "episodes_from": loop.url,
                    "episodes_key_file": str(key_file),
                },
                "evaluation": {"eval_every": s.retrain_iterations, "benchmark_id": pinned},
                "registry": {"live_gate": True},
            },
        )
        if summary is None:
            return "skipped (nothing new)"
        p = summary["promotion"]
        verdict = "promoted" if p["promote"] else "canary" if p["canary"] else "rejected"
        return f"v{p.get('challenger_version')} {verdict} ({p['reason']})"

    # --- serving -------------------------------------------------------------------------------

    def serve(self, stack: ExitStack, name: str, *flags: str) -> tuple[Server, Path]:
        port = _free_port()
        db = self.out / name / "store.duckdb"
        command = [
            sys.executable,
            "-m",
            "lightning_rl.flows.cli",
            "production",
            "--agent",
            "calc",
            "--port",
            str(port),
            "--db",
            str(db),
            "--tracking-uri",
            self.registry.tracking_uri,
            "--registered-model",
            REGISTERED_MODEL,
            *flags,
        ]
        if self.settings.model:
            command += ["--model", self.settings.model]
        threads = self.settings.server_threads or max(1, len(os.sched_getaffinity(0)) // 2)
        command += ["--backend-options", json.dumps({"threads": threads})]
        env = {k: v for k, v in self.env.items() if k != "LIGHTNING_API_KEY"}
        log = stack.enter_context((self.out / "state" / f"{name}.log").open("w"))
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        stack.callback(_stop, proc)
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]  # read by wait_healthy
        try:
            # The base model loads in seconds; a machine busy with training takes longer.
            wait_healthy(proc, port, timeout=300, what=f"the {name} production server")
        except LightningError as exc:
            sys.exit(str(exc))
        url = f"http://127.0.0.1:{port}"
        key_file = Path(f"{db}.key")
        return Server(url, key_file.read_text().strip()), key_file

    # --- the weeks -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        s = self.settings
        started = time.monotonic()
        w0 = self.week0()
        pinned = w0["benchmark_id"]
        first = aliases(self.registry)["champion"]
        assert first is not None  # week0() exits otherwise
        live = {
            "poll_s": s.poll_s,
            "canary_fraction": s.canary_fraction,
            "gate": {"min_episodes": s.gate_min_episodes, "tau": s.gate_tau},
        }
        weeks: list[dict[str, Any]] = []
        with ExitStack() as stack:
            loop, key_file = self.serve(stack, "loop", "--live", json.dumps(live))
            frozen, _ = self.serve(stack, "frozen", "--policy", first)
            clock = PromotionClock(self.registry, loop.url, loop.key, s.probe_s).start()
            stack.callback(clock.stop)
            late: list[tuple[str, float]] = []
            before = versions(self.registry)
            for week in range(1, s.weeks + 1):
                send_late(loop, late)  # last week's late feedback arrives now
                drift = s.drift(week)
                tasks = fresh_tasks(s.episodes_per_week, seed=1000 * s.seed + week, drift=drift)
                t0 = time.monotonic()
                print(f"week {week}: {len(tasks)} users, drift {drift:.2f}", flush=True)
                users = asyncio.run(run_week(week, tasks, loop, frozen, s))
                late = users.late
                # Two looks of the follower: the live gate has seen this week's feedback.
                time.sleep(2 * s.poll_s)
                served = aliases(self.registry)
                row = _row(week, drift, users, served, time.monotonic() - t0)
                # The last week is the measurement: its retraining would be canaried next week.
                row["retrain"] = (
                    self.retrain(week, loop, key_file, pinned) if week < s.weeks else "not run"
                )
                after = versions(self.registry)
                row["decisions"] = changes(before, after)
                champion = aliases(self.registry)["champion"]
                row["champion_after"] = champion
                score = after.get(champion or "", {}).get(TAG_SCORE)
                row["benchmark"] = None if score is None else float(score)
                before = after
                weeks.append(row)
                print(_line(row), flush=True)
            clock.stop()
            tags = versions(self.registry)
            last = weeks[-1]
            return {
                "settings": s.model_dump(),
                "pinned_benchmark": pinned,
                "week0": {"score": w0["final"]["score"], "version": first},
                "weeks": weeks,
                "versions": tags,
                "problems": problems(self.registry, first, pinned, tags),
                "promotion_to_serving_s": clock.times,
                "production_recovery_points": last["gain_points"],
                "production_recovery_ci": last["gain_ci_points"],
                "minutes": round((time.monotonic() - started) / 60, 1),
            }


def _row(
    week: int, drift: float, users: Week, served: dict[str, str | None], seconds: float
) -> dict[str, Any]:
    episodes = sorted(users.loop)
    loop = np.array([users.loop[e] for e in episodes], dtype=float)
    frozen = np.array([users.frozen[e] for e in episodes], dtype=float)
    low, high = paired_bootstrap(loop - frozen)
    n = len(episodes)
    return {
        "week": week,
        "drift": drift,
        "episodes": n,
        "errors": users.errors,
        "feedback": {
            "on_time": users.sent,
            "late": len(users.late),
            "missing": users.missing,
            "flipped": users.flipped,
        },
        "loop": float(loop.mean()),
        "loop_ci": wilson_interval(int(loop.sum()), n),
        "frozen": float(frozen.mean()),
        "frozen_ci": wilson_interval(int(frozen.sum()), n),
        "gain_points": round(100 * float((loop - frozen).mean()), 1),
        "gain_ci_points": [round(100 * low, 1), round(100 * high, 1)],
        "champion": served["champion"],
        "challenger": served["challenger"],
        "seconds": round(seconds),
    }


def _line(row: dict[str, Any]) -> str:
    return (
        f"week {row['week']}: loop {row['loop']:.1%}, frozen {row['frozen']:.1%}, "
        f"{row['gain_points']:+.1f} points; champion v{row['champion_after']}; "
        f"retrain {row['retrain']}"
    )


def report(result: dict[str, Any], save: bool = True, variant: str | None = None) -> None:
    """The per-week table, the registry's decisions and the figure lines."""
    print(
        f"pinned benchmark {result['pinned_benchmark']}: week 0 champion "
        f"v{result['week0']['version']} scored {result['week0']['score']:.1%}"
    )
    print(
        "| week | drift | episodes | feedback on time / late / missing / flipped | loop "
        "(95 % CI) | frozen champion (95 % CI) | loop - frozen, points (paired 95 % CI) "
        "| served champion / challenger | pinned benchmark after | retraining |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["weeks"]:
        f = r["feedback"]
        bench = "-" if r["benchmark"] is None else f"{r['benchmark']:.1%}"
        # Week 0's version carries both aliases until a canary starts: only a canary counts.
        canary = r["challenger"] not in (None, r["champion"])
        challenger = f"v{r['challenger']}" if canary else "-"
        print(
            f"| {r['week']} | {r['drift']:.0%} | {r['episodes']} "
            f"| {f['on_time']} / {f['late']} / {f['missing']} / {f['flipped']} "
            f"| {r['loop']:.1%} ({r['loop_ci'][0]:.1%} - {r['loop_ci'][1]:.1%}) "
            f"| {r['frozen']:.1%} ({r['frozen_ci'][0]:.1%} - {r['frozen_ci'][1]:.1%}) "
            f"| {r['gain_points']:+.1f} ({r['gain_ci_points'][0]:+.1f} to "
            f"{r['gain_ci_points'][1]:+.1f}) "
            f"| v{r['champion']} / {challenger} "
            f"| {bench} | {r['retrain']} |"
        )
    print("registry decisions:")
    for r in result["weeks"]:
        print(f"  week {r['week']}: {'; '.join(r['decisions']) or 'none'}")
    print(f"registry consistent: {'; '.join(result['problems']) or 'yes'}")
    low, high = result["production_recovery_ci"]
    kept = {"save": save, "variant": variant}
    record("production_recovery_points", f"{result['production_recovery_points']:.1f}", **kept)
    ci = f"{low:+.1f} to {high:+.1f}"
    record("production_recovery_ci", ci, suffix=" (paired bootstrap 95 %)", **kept)
    times = result["promotion_to_serving_s"]
    if times:
        record("promotion_to_serving_s", f"{max(times):.2f}", **kept)
    else:
        print("promotion_to_serving_s: n/a (no promotion)")
    record("minutes", result["minutes"], **kept)


def _merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _settings(pairs: list[str], quick: bool) -> DriftSettings:
    values: dict[str, Any] = dict(QUICK) if quick else {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            sys.exit(f"--set takes KEY=VALUE, not {pair!r}")
        values[key] = value
    try:
        return DriftSettings(**values)
    except ValidationError as exc:
        found = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        sys.exit(f"invalid drift setting: {found}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of the demo's runs, servers and result.json (default "
        f"{DEFAULT_OUT}; with --quick a temporary folder)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 2 weeks, a few episodes, in a temporary folder",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a DriftSettings field (benchmarks/drift/settings.py)",
    )
    args = parser.parse_args(argv)
    settings = _settings(args.set, args.quick)
    with ExitStack() as stack:
        out = args.out or DEFAULT_OUT
        if args.quick and args.out is None:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="drift-quick-")))
        elif out.exists() and any(out.iterdir()):
            sys.exit(f"{out} is not empty: a demo starts from a new registry (--out elsewhere)")
        out.mkdir(parents=True, exist_ok=True)
        result = Demo(out, settings).run()
        (out / "result.json").write_text(json.dumps(result, indent=1))
        # Settings other than the defaults (--set) make figures of their own.
        report(result, save=not args.quick, variant=", ".join(args.set) or None)
        if not (args.quick and args.out is None):
            print(f"result: {out / 'result.json'}")


if __name__ == "__main__":
    main()
