"""Screenshots of the production side in the Prefect UI (`make screenshots`, after the training
run's): the production retraining deployment's runs, the automation that reloads the policy and
the registry's `lightning.model.*` events.

On the Prefect server docs/screenshots.py starts, as docs/production.md and prefect.yaml set it
up: a SQLite MLflow registry in the temporary folder gets a first champion (its
`lightning.model.promoted` event), a `lightning-rl production` server (tiny model) follows it, an
automation on `lightning.model.*` calls the server's `/hooks/reload` through a Webhook block,
and a second version goes to a canary (`lightning.model.canary-started`, which the automation
acts on). Then `train/calc-production` is deployed from prefect.yaml and run once through a
process worker against that server: with no episode feedback yet it trains nothing and ends
Completed, as a daily run before any feedback does. Saves docs/prefect-production-runs.png,
docs/prefect-automation.png, docs/prefect-automation-trigger.png and
docs/prefect-model-events.png. `python docs/screenshots_production.py` retakes only these.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import screenshots as shots

DEPLOYMENT = "train/calc-production"
WORK_POOL = "lightning-process"  # prefect.yaml's
REGISTERED_MODEL = "lightning-calc"
AUTOMATION = f"reload {REGISTERED_MODEL}"
SECRET = "reload-secret-for-screenshots"
MODEL_EVENTS = ["lightning.model.promoted", "lightning.model.canary-started"]
# What the automation did on the canary's event: in the same feed, waited for as well.
AUTOMATION_EVENTS = ["prefect.automation.triggered", "prefect.automation.action.executed"]
ACTION_FAILED = "prefect.automation.action.failed"
# The event feed is reloaded up to this many times, waiting this long for each event.
EVENT_FEED_RELOADS = 4
EVENT_FEED_WAIT_MS = 20_000
# A worker asks for scheduled runs every 2 s instead of 10: the screenshot waits less.
WORKER_ENV = {"PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_CLI_PROMPT": "false"}


@dataclass
class ProductionDemo:
    """What the production pages show, on the server at `ui`."""

    ui: str
    deployment_id: str
    flow_run_name: str
    automation_id: str
    registered_model: str = REGISTERED_MODEL


def _env(ui: str, work: Path) -> dict[str, str]:
    """A client's environment: the server's API, Prefect's client state in the temporary folder
    and this repository importable (prefect.yaml's entrypoints are its files)."""
    return {
        **os.environ,
        **shots.SERVER_ENV,
        **WORKER_ENV,
        "PREFECT_API_URL": f"{ui}/api",
        "PREFECT_HOME": str(work / "prefect-client"),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(shots.REPO), os.environ.get("PYTHONPATH")])
        ),
    }


@contextlib.contextmanager
def _using(ui: str) -> Iterator[None]:
    """Prefect calls in this process (blocks, automations, events) go to the server at `ui`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from lightning_rl.flows.prefect_server import flush_to_server

    with temporary_settings(updates={PREFECT_API_URL: f"{ui}/api"}):
        try:
            yield
        finally:
            # Events are sent by a background worker: out before the block's server is left.
            flush_to_server()


def _adapter(folder: Path) -> Path:
    """A LoRA adapter on the tiny test model (random, as the training screenshots' model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_core.models import tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(
        folder
    )
    return folder


def _register(registry: Any, adapter: Path, policy_version: str, score: float) -> None:
    """Register a version as a training flow does at its end (the registry emits the event)."""
    from lightning_rl.registry.versions import register_policy_version

    register_policy_version(
        registry,
        adapter,
        base_model="tiny",
        policy_version=policy_version,
        iteration=1,
        score=score,
        benchmark_id="screenshots",
        benchmark_size=50,
    )


def create_reload_automation(ui: str, hook_url: str) -> str:
    """docs/production.md's automation (as tests/test_production_live.py creates it): on the
    model's `lightning.model.*` events, POST the production server's reload hook."""
    from prefect.automations import Automation
    from prefect.blocks.webhook import Webhook
    from prefect.events.actions import CallWebhook
    from prefect.events.schemas.automations import EventTrigger

    with _using(ui):
        hook = Webhook(
            method="POST",
            url=hook_url,
            headers={"X-Lightning-Reload-Secret": SECRET},
            allow_private_urls=True,
        )
        automation = Automation(
            name=AUTOMATION,
            # The UI's pages call an event trigger with a match "A custom trigger": say it here.
            description=f"On {REGISTERED_MODEL}'s lightning.model.* events (a promotion, a "
            "canary started or ended, a rollback), POST the production server's /hooks/reload.",
            trigger=EventTrigger(
                expect={"lightning.model.*"},
                match={"mlflow.registered_model": REGISTERED_MODEL},
                posture="Reactive",
                threshold=1,
            ),
            actions=[CallWebhook(block_document_id=hook.save("lightning-reload"))],
        ).create()
    return str(automation.id)


@contextlib.contextmanager
def production_server(work: Path, registry: Any, hook_port: int) -> Iterator[str]:
    """`lightning-rl production` (tiny model) following `registry`, its reload hook on
    `hook_port`; yields its URL. Polling every 5 minutes: only the hook makes it look."""
    port = shots.free_port()
    url = f"http://127.0.0.1:{port}"
    live = {"poll_s": 300, "webhook_port": hook_port}
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_API_KEY"}
    # By environment: `--live` refuses a secret, which a command line shows to every user.
    env["LIGHTNING_LIVE_WEBHOOK_SECRET"] = SECRET
    cli = Path(sys.executable).with_name("lightning-rl")
    log = (work / "production.log").open("w")
    server = subprocess.Popen(
        [str(cli), "production", "--model", "tiny", "--port", str(port),
         "--db", str(work / "production" / "calc.duckdb"),
         "--tracking-uri", registry.tracking_uri, "--registered-model", registry.registered_model,
         "--live", json.dumps(live)],
        cwd=shots.REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_healthy(f"{url}/health", server, work / "production.log")
        yield url
    finally:
        _stop(server)
        log.close()


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy in {timeout:.0f} s: {log.read_text()[-3000:]}")
        time.sleep(0.5)


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_production_deployment(ui: str, work: Path, production: str, registry: Any) -> str:
    """Deploy `train/calc-production` from prefect.yaml (`prefect deploy`), run it once through
    a process worker on the episodes of `production` and return the flow run's name. Its
    parameters replace the deployment's sections that point at this machine's real server,
    registry and benchmark (Prefect merges them one name deep)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate

    env = _env(ui, work)
    with SyncPrefectClient(f"{ui}/api") as client:
        client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="process"))
    _prefect(env, "deploy", "--name", DEPLOYMENT.split("/")[1], "--no-prompt")
    params = {
        "data": {
            "source": "episodes",
            "episodes_from": production,
            "episodes_key_file": str(work / "production" / "calc.duckdb.key"),
        },
        "registry": {**registry.model_dump(mode="json"), "live_gate": True},
        "server": {"model": "tiny"},
        "evaluation": {"eval_size": 3, "benchmark_id": None},
        "run_dir": str(work / "runs"),
    }
    with (work / "worker.log").open("w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", WORK_POOL],
            cwd=shots.REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            run = _prefect(
                env, "deployment", "run", DEPLOYMENT, "--params", json.dumps(params),
                "--watch", "--watch-timeout", "600", timeout=700,
            )  # fmt: skip
        finally:
            _stop(worker)
    if "Completed" not in run.stdout:
        raise RuntimeError(f"{DEPLOYMENT} did not complete:\n{run.stdout}\n"
                           + (work / "worker.log").read_text()[-3000:])  # fmt: skip
    with SyncPrefectClient(f"{ui}/api") as client:
        deployment = client.read_deployment_by_name(DEPLOYMENT)
        runs = client.read_flow_runs(
            deployment_filter=_deployment_filter(str(deployment.id)), limit=1
        )
    return runs[0].name


def _deployment_filter(deployment_id: str) -> Any:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    return DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))


def _prefect(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=shots.REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr[-3000:]}")
    return done


def production_demo(ui: str, work: Path) -> ProductionDemo:
    """The registry, production server, automation and deployment run the pages show."""
    import mlflow
    from prefect.client.orchestration import SyncPrefectClient

    from lightning_rl.registry.config import RegistryConfig

    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    registry = RegistryConfig(
        tracking_uri=uri, registered_model=REGISTERED_MODEL, promotion_threshold=0.3
    )
    adapter = _adapter(work / "adapter")
    # MLflow's process-wide URIs too (runs are logged through them), put back after: a test
    # process goes on.
    prior = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        with _using(ui):
            _register(registry, adapter, "calc-v1", 0.5)  # the first champion: promoted
        hook_port = shots.free_port()
        with production_server(work, registry, hook_port) as production:
            hook_url = f"http://127.0.0.1:{hook_port}/hooks/reload"
            automation_id = create_reload_automation(ui, hook_url)
            with _using(ui):
                # Better on the benchmark, with the live gate on: a canary on live traffic.
                canary = registry.model_copy(update={"live_gate": True})
                _register(canary, adapter, "calc-v2", 0.6)
            flow_run_name = run_production_deployment(ui, work, production, registry)
            # The event feed reads what the server holds when the page loads; the events are
            # sent asynchronously (the canary's came after the page once), so wait until all
            # are stored. Inside this block: the automation's webhook action may run late,
            # and it must find the production server still up, or it fails (CI once).
            wait_for_events(ui, MODEL_EVENTS + AUTOMATION_EVENTS)
    finally:
        mlflow.set_tracking_uri(prior[0])
        mlflow.set_registry_uri(prior[1])
    with SyncPrefectClient(f"{ui}/api") as client:
        deployment = client.read_deployment_by_name(DEPLOYMENT)
    return ProductionDemo(
        ui=ui,
        deployment_id=str(deployment.id),
        flow_run_name=flow_run_name,
        automation_id=automation_id,
    )


def wait_for_events(ui: str, names: list[str], timeout_s: float = 120.0) -> None:
    """Wait until the Prefect server has stored an event of each name (its events API)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    failed: list[dict] = []
    while time.monotonic() < deadline:
        # Failed actions too: their reasons are what a failure here should say.
        wanted = [*names, ACTION_FAILED]
        body = {"filter": {"event": {"name": wanted}}, "limit": 50}  # the API's page cap
        reply = httpx.post(f"{ui}/api/events/filter", json=body, timeout=30)
        reply.raise_for_status()
        events = reply.json()["events"]
        seen = {event["event"] for event in events}
        if seen >= set(names):
            return
        failed = [event for event in events if event["event"] == ACTION_FAILED]
        time.sleep(0.5)
    reasons = [event.get("payload") for event in failed]
    raise RuntimeError(
        f"the Prefect server never stored {sorted(set(names) - seen)}"
        + (f"; an automation action failed: {reasons}" if failed else "")
    )


def _wait_for(page: Any, texts: list[str], *, exact: bool = False) -> None:
    from playwright.sync_api import expect

    for text in texts:
        shown = page.get_by_text(text, exact=exact).first
        expect(shown, repr(text)).to_be_visible(timeout=shots.UI_TIMEOUT_MS)
    time.sleep(shots.GRAPH_SETTLE_S)


def show_production_runs(page: Any, demo: ProductionDemo) -> None:
    """The deployment's page, its runs listed: wait for the run's name and Completed."""
    page.goto(f"{shots.ui_root(demo.ui)}/deployments/deployment/{demo.deployment_id}")
    _wait_for(page, ["calc-production", demo.flow_run_name, "Completed"])


def show_automation(page: Any, demo: ProductionDemo) -> None:
    """The automation's page: its description and its Call webhook action."""
    page.goto(f"{shots.ui_root(demo.ui)}/automations/automation/{demo.automation_id}")
    _wait_for(page, [AUTOMATION, "Call webhook using", "lightning-reload"])


def show_automation_trigger(page: Any, demo: ProductionDemo) -> None:
    """The automation's trigger as its editor's JSON tab shows it (the event names and the
    match on the model), which the automation's page only calls "A custom trigger". Nothing
    is saved."""
    page.goto(f"{shots.ui_root(demo.ui)}/automations/automation/{demo.automation_id}/edit")
    page.get_by_text("JSON", exact=True).click()
    _wait_for(page, ["lightning.model.*", "mlflow.registered_model"])


def show_model_events(page: Any, demo: ProductionDemo) -> None:
    """The event feed filtered to the registry's events and the automation's, oldest first
    (the promotion, the canary, the automation acting on it); waits for each event's name
    (exact: the filter box lists them too) and grows the window to show them all."""
    from playwright.sync_api import Error as PlaywrightError

    events = quote(json.dumps(MODEL_EVENTS + AUTOMATION_EVENTS))
    # An explicit window around now: with the feed's default ("past day") the page once
    # listed the promotion but not the canary's and the automation's events, stored seconds
    # later (wait_for_events) yet outside the window the page had computed.
    now = datetime.now(UTC)
    start, end = (
        quote((now + timedelta(hours=h)).strftime("%Y-%m-%dT%H:%M:%S.000Z")) for h in (-1, 1)
    )
    page.goto(
        f"{shots.ui_root(demo.ui)}/events/?events={events}&order=ASC"
        f"&rangeType=range&start={start}&end={end}"
    )
    # The feed queries the server when the page loads and not again: reload it while an
    # event is missing (CI runs the tests in parallel, and a slow reply once came back empty).
    for _ in range(EVENT_FEED_RELOADS):
        try:
            for text in MODEL_EVENTS + AUTOMATION_EVENTS:
                shown = page.get_by_text(text, exact=True).first
                shown.wait_for(state="visible", timeout=EVENT_FEED_WAIT_MS)
            break
        except PlaywrightError:
            page.reload()
    _wait_for(page, MODEL_EVENTS + AUTOMATION_EVENTS, exact=True)
    shots._grow_to(page, page.evaluate("document.scrollingElement.scrollHeight"), most=1800)
    time.sleep(shots.GRAPH_SETTLE_S)


def take_production_screenshots(
    page: Any, demo: ProductionDemo, folder: Path = shots.DOCS
) -> list[Path]:
    """The production screenshots in `folder`; returns their paths."""
    taken = []
    for show, name in [
        (show_production_runs, "prefect-production-runs.png"),
        (show_automation, "prefect-automation.png"),
        (show_automation_trigger, "prefect-automation-trigger.png"),
        (show_model_events, "prefect-model-events.png"),
    ]:
        page.set_viewport_size(shots.VIEWPORT)
        show(page, demo)
        taken.append(folder / name)
        page.screenshot(path=taken[-1])
    return taken


def main() -> None:
    """Only these screenshots, on a server of their own (docs/screenshots.py takes all)."""
    import tempfile

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lightning-rl-ui-") as tmp:
        work = Path(tmp)
        with shots.prefect_server(work / "prefect-home") as ui:
            demo = production_demo(ui, work / "production")
            print(f"production side ({time.monotonic() - started:.0f} s): {demo}", flush=True)
            with shots.browser() as page:
                taken = take_production_screenshots(page, demo)
    for shot in taken:
        print(f"{shot.relative_to(shots.REPO)}: {shot.stat().st_size // 1024} KB")
    print(f"done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
