"""What a user sees of a training run in the Prefect UI (slow): a real Prefect server, a tiny
`lightning-rl train` run against it, and the run's pages in headless Chromium, the pages and
checks of docs/screenshots.py (`make screenshots`); and the production side's pages, those of
docs/screenshots_production.py."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 3


def _load_screenshots() -> ModuleType:
    # docs/ is no package: the script is loaded by path, as `make screenshots` runs it.
    name = "lightning_rl_docs_screenshots"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "screenshots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclass looks its own module up in sys.modules.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


shots = _load_screenshots()


def _load_production_screenshots() -> ModuleType:
    # It imports its sibling as `screenshots` (docs/ is on sys.path when run as a script):
    # given the module loaded above under that name, not a second copy.
    sys.modules.setdefault("screenshots", shots)
    name = "lightning_rl_docs_screenshots_production"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "screenshots_production.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as _load_screenshots: for its dataclass
    spec.loader.exec_module(module)
    return module


def _require_browser() -> None:
    """Skip without Playwright or Chromium, unless on CI: .ci/run installs both, so there a
    missing browser is a broken setup, not a machine without one."""
    missing = None
    if importlib.util.find_spec("playwright") is None:
        missing = "playwright is not installed (pip install -e '.[dev]')"
    elif not shots.CHROMIUM.exists():
        missing = f"{shots.CHROMIUM} is missing (apt-get install -y chromium)"
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must have a browser for the Prefect UI test: {missing}")
    pytest.skip(f"no headless browser for the Prefect UI: {missing}")


def test_the_prefect_ui_shows_the_iterations_the_logs_and_the_reward_curve(tmp_path):
    """At staleness 1 (rollouts sampled ahead of training), whose run page lists each
    iteration's rollouts as a subflow run of its own beside the iteration's; `make
    screenshots` takes the same pages at staleness 0."""
    _require_browser()
    with shots.prefect_server(tmp_path / "prefect-home") as ui:
        run = shots.train_demo(ui, tmp_path / "train", iterations=ITERATIONS, staleness=1)
        with shots.browser() as page:
            try:
                subflows = shots.show_subflows(page, run)
                logs = shots.show_logs(page, run)
                curve = shots.show_report(page, run)
            except AssertionError as exc:
                # What the browser showed instead, for whoever reads the failure.
                page.screenshot(path=tmp_path / "failure.png")
                raise AssertionError(f"{exc}\n(the page: {tmp_path / 'failure.png'})") from exc
    assert subflows == [
        f"{kind}-{k}" for k in range(1, ITERATIONS + 1) for kind in ("iteration", "rollouts")
    ]
    assert any(f"run {run.run_name} in " in row for row in logs), logs
    assert any("held-out after iteration" in row for row in logs), logs
    assert curve["width"] > 0 and curve["height"] > 0, f"the reward curve did not render: {curve}"


def test_the_prefect_ui_shows_the_production_deployment_the_automation_and_the_events(tmp_path):
    """The production pages `make screenshots` takes (docs/screenshots_production.py): the
    calc-production deployment's Completed run, the reload automation (its webhook action and
    its trigger on lightning.model.*) and the registry's events with the automation acting."""
    _require_browser()
    production = _load_production_screenshots()
    with shots.prefect_server(tmp_path / "prefect-home") as ui:
        demo = production.production_demo(ui, tmp_path / "production")
        with shots.browser() as page:
            try:
                taken = production.take_production_screenshots(page, demo, tmp_path)
            except AssertionError as exc:
                page.screenshot(path=tmp_path / "failure.png")
                raise AssertionError(f"{exc}\n(the page: {tmp_path / 'failure.png'})") from exc
    assert all(shot.stat().st_size > 0 for shot in taken), taken
