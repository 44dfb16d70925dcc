"""Screenshots of a training run in the Prefect UI, as a user sees it (`make screenshots`).

Starts a real Prefect server on loopback (its own PREFECT_HOME in a temporary folder), runs a
short training of the tiny test model through the `lightning-rl train` command as users do,
then opens the run in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright) and
saves docs/prefect-run-page.png (the iteration subflows), docs/prefect-run-logs.png (the run's
logs) and docs/prefect-training-report.png (the report artifact and its reward curve). Then, on
the same server, docs/screenshots_production.py takes the production side's pages (the
calc-production deployment's run, the reload automation, the registry's events).

tests/test_prefect_ui.py imports both files' functions to check the same pages.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CHROMIUM = Path("/usr/bin/chromium")
# Without these Chromium reaches out to Google (updates, sync, QUIC probes); this machine's
# network refuses that, and a screenshot must not depend on it anyway.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 900}
# How long a page may take to show what is checked: the UI loads, then polls the API.
UI_TIMEOUT_MS = 60_000
# The run graph above the tabs is drawn on a canvas, with no text to wait for: time to settle.
GRAPH_SETTLE_S = 2.0
# The settings a user has on a fresh `prefect server start`, minus the upgrade banners (they
# would take the top of every screenshot) and the usage telemetry.
SERVER_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
}


@dataclass
class DemoRun:
    """A finished training run on a Prefect server: where to look at it."""

    ui: str  # http://127.0.0.1:<port>
    flow_run_id: str
    flow_run_name: str
    run_name: str
    iterations: int
    report_key: str
    report_id: str
    run_dir: Path
    staleness: int = 0  # above 0, each iteration's rollouts are a subflow of their own too

    def subflows(self) -> list[str]:
        """The subflow runs the run page lists: iteration-k and, with staleness, rollouts-k."""
        kinds = ["iteration", "rollouts"] if self.staleness else ["iteration"]
        return [f"{kind}-{k}" for k in range(1, self.iterations + 1) for kind in kinds]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prefect_server(home: Path, timeout: float = 180) -> Iterator[str]:
    """`prefect server start` on a free loopback port; yields its URL (the UI, the API under
    /api). The server's stdout goes to home/server.log."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        **SERVER_ENV,
        "PREFECT_HOME": str(home),
        # As settings, not only flags: the UI's API URL comes from these settings, and with
        # `--port` alone the page the server sends calls the API on the default port 4200.
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
    }
    # The server would otherwise take an API URL meant for clients as its own.
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_UI_API_URL", None)
    env.pop("PREFECT_SERVER_UI_API_URL", None)
    log = (home / "server.log").open("w")
    command = [sys.executable, "-m", "prefect", "server", "start"]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        # Its own process group: the server runs uvicorn (and services) as children, which
        # must all go when we stop it.
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(
                    f"prefect server exited with {server.returncode}:\n"
                    + (home / "server.log").read_text()[-3000:]
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefect server did not become healthy in {timeout:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def train_demo(
    ui: str,
    workdir: Path,
    *,
    iterations: int = 3,
    run_name: str = "ui-demo",
    staleness: int = 0,
    timeout: float = 600,
) -> DemoRun:
    """Train the tiny model on the flow test agent through `lightning-rl train`, reporting to
    the Prefect server at `ui`, MLflow in workdir/mlflow.db; returns where the run is shown.
    With a staleness, each iteration's rollouts are sampled ahead, in a subflow run of their
    own (flows/pipeline.py)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cli = Path(sys.executable).with_name("lightning-rl")
    command = [
        str(cli),
        "train",
        "--quiet",
        "--agent",
        "tests.flow_agents:agent",
        "--tasks",
        "tests.flow_agents:load_tasks",
        "--model",
        "tiny",
        "--iterations",
        str(iterations),
        "--tasks-per-iteration",
        "3",
        "--group-size",
        "4",
        "--eval-size",
        "6",
        "--eval-every",
        "1",
        "--run-dir",
        str(workdir / "runs"),
        "--run-name",
        run_name,
        "--staleness",
        str(staleness),
    ]
    env = {
        **os.environ,
        **SERVER_ENV,
        "PREFECT_API_URL": f"{ui}/api",
        # Prefect's client state (profiles, local results) stays in the temporary folder.
        "PREFECT_HOME": str(workdir / "prefect-client"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",
        # The agent, tests.flow_agents, is a module of this repository: importable as a
        # user's own agent module must be (`train` does not look in the current directory).
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"lightning-rl train failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-5000:]}"
        )
    flow_run = _read_train_run(ui)
    report = _read_report(ui, flow_run["id"])
    return DemoRun(
        ui=ui,
        flow_run_id=flow_run["id"],
        flow_run_name=flow_run["name"],
        run_name=run_name,
        iterations=iterations,
        report_key=report["key"],
        report_id=report["id"],
        run_dir=workdir / "runs" / run_name,
        staleness=staleness,
    )


def _read_train_run(ui: str) -> dict[str, Any]:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with SyncPrefectClient(f"{ui}/api") as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])))
    if len(runs) != 1:
        raise RuntimeError(f"expected one flow run of 'train' on the server, found {len(runs)}")
    return {"id": str(runs[0].id), "name": runs[0].name}


def _read_report(ui: str, flow_run_id: str) -> dict[str, Any]:
    """The run's training report: its markdown artifact keyed `<agent>-training-report`."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with SyncPrefectClient(f"{ui}/api") as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    reports = [a for a in artifacts if (a.key or "").endswith("-training-report")]
    if not reports:
        keys = sorted(a.key or "(no key)" for a in artifacts)
        raise RuntimeError(f"no *-training-report artifact on the train run; artifacts: {keys}")
    return {"key": reports[0].key, "id": str(reports[0].id)}


@contextlib.contextmanager
def browser() -> Iterator[Any]:
    """Headless Chromium (the system's) under Playwright; yields a page at VIEWPORT.

    Playwright launches it on a fresh temporary profile (user-data-dir) every time, so nothing
    of an earlier session (a saved choice of UI version, say) changes what is shown."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise FileNotFoundError(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = chromium.new_page(viewport=VIEWPORT, color_scheme="light")
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield page
        finally:
            chromium.close()


def ui_root(ui: str) -> str:
    """The URL of the UI a user lands on from the server's address: the server's default UI
    version (V2, under /v2, in Prefect 3.9), as its /ui-settings says."""
    settings = httpx.get(f"{ui}/ui-settings", timeout=10).raise_for_status().json()
    default = settings.get("default_ui") or "v1"
    base = settings.get(f"{default}_base_url") or "/"
    return ui + base.rstrip("/")


def run_page_url(run: DemoRun, tab: str) -> str:
    return f"{ui_root(run.ui)}/runs/flow-run/{run.flow_run_id}?tab={tab}"


def report_url(run: DemoRun) -> str:
    return f"{ui_root(run.ui)}/artifacts/artifact/{run.report_id}"


def show_subflows(page: Any, run: DemoRun) -> list[str]:
    """Open the run page on its Subflow Runs tab; wait until `iteration-1` … `iteration-N`
    (and `rollouts-1` … `rollouts-N` with staleness) are rows there (AssertionError if not)
    and return their names."""
    from playwright.sync_api import expect

    page.goto(run_page_url(run, "SubflowRuns"))
    names = run.subflows()
    for name in names:
        expect(page.get_by_text(name, exact=True), f"subflow row {name}").to_be_visible(
            timeout=UI_TIMEOUT_MS
        )
    time.sleep(GRAPH_SETTLE_S)
    return names


def show_logs(page: Any, run: DemoRun, messages: list[str] | None = None) -> list[str]:
    """Open the run page on its Logs tab; wait until each of `messages` (starts of log
    messages; by default the run's first line and a held-out result) is shown on an INFO log
    row, and return those rows' text."""
    from playwright.sync_api import expect

    page.goto(run_page_url(run, "Logs"))
    messages = messages or [f"run {run.run_name} in ", "held-out after iteration"]
    rows = []
    for message in messages:
        line = page.get_by_text(message).first
        expect(line, f"log line {message!r}").to_be_visible(timeout=UI_TIMEOUT_MS)
        # The level is a badge in the same row, a few elements up from the message.
        row = line.evaluate(
            """e => { for (let n = e, i = 0; n && i < 5; n = n.parentElement, i++)
                          if (/^INFO$/m.test(n.innerText)) return n.innerText;
                      return null; }"""
        )
        assert row is not None, f"log line {message!r} is shown, but not as INFO"
        rows.append(row)
    time.sleep(GRAPH_SETTLE_S)
    return rows


def show_report(page: Any, run: DemoRun) -> dict[str, Any]:
    """Open the training report artifact; wait until its inline reward curve (a data: PNG in
    the markdown) has loaded and return the image's natural size (0 wide: not rendered)."""
    from playwright.sync_api import expect

    page.goto(report_url(run))
    curve = page.locator('img[src^="data:image/png;base64,"]').first
    expect(curve, "the report's inline reward curve").to_be_visible(timeout=UI_TIMEOUT_MS)
    page.wait_for_function("img => img.complete", arg=curve.element_handle())
    return curve.evaluate(
        """img => ({width: img.naturalWidth, height: img.naturalHeight,
                   bottom: img.getBoundingClientRect().bottom + window.scrollY})"""
    )


def _grow_to(page: Any, bottom: float, most: int = 1400) -> None:
    """Make the window tall enough to show everything down to `bottom` (at most `most` px),
    so one screenshot shows all rows or the whole curve, with the UI's own layout."""
    height = max(VIEWPORT["height"], min(most, int(bottom) + 24))
    page.set_viewport_size({"width": VIEWPORT["width"], "height": height})


def take_screenshots(page: Any, run: DemoRun, folder: Path = DOCS) -> list[Path]:
    """The three screenshots of `run` in `folder`; returns their paths."""
    shots = []
    names = show_subflows(page, run)
    # Below each row's name: its state, start, duration and task runs (the card ends about
    # 50 px lower; the pager follows some 15 px below it).
    bottom = max(
        page.get_by_text(name, exact=True).evaluate(
            "e => e.getBoundingClientRect().bottom + window.scrollY"
        )
        for name in names
    )
    _grow_to(page, bottom + 36)
    time.sleep(GRAPH_SETTLE_S)
    shots.append(folder / "prefect-run-page.png")
    page.screenshot(path=shots[-1])

    page.set_viewport_size(VIEWPORT)
    show_logs(page, run)
    _grow_to(page, page.evaluate("document.scrollingElement.scrollHeight"))
    time.sleep(GRAPH_SETTLE_S)
    shots.append(folder / "prefect-run-logs.png")
    page.screenshot(path=shots[-1])

    page.set_viewport_size(VIEWPORT)
    curve = show_report(page, run)
    _grow_to(page, curve["bottom"])
    shots.append(folder / "prefect-training-report.png")
    page.screenshot(path=shots[-1])
    return shots


def main() -> None:
    # Beside this file (docs/, on sys.path as the script's folder); it imports this module.
    import screenshots_production as production

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lightning-rl-ui-") as tmp:
        work = Path(tmp)
        with prefect_server(work / "prefect-home") as ui:
            print(f"prefect server at {ui} ({time.monotonic() - started:.0f} s)", flush=True)
            run = train_demo(ui, work / "train")
            print(f"trained ({time.monotonic() - started:.0f} s): {run}", flush=True)
            demo = production.production_demo(ui, work / "production")
            print(f"production side ({time.monotonic() - started:.0f} s): {demo}", flush=True)
            with browser() as page:
                shots = take_screenshots(page, run)
                shots += production.take_production_screenshots(page, demo)
    for shot in shots:
        print(f"{shot.relative_to(REPO)}: {shot.stat().st_size // 1024} KB")
    print(f"done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
