"""The MLflow registry on a real SQLite file: run tracking, registering adapters as versions,
gated promotion (the rule itself: tests/test_promotion.py) on scores of one benchmark only,
events, lookups, registering again from the same run (a resumed or retried flow) without a
second version, and the promotion lock between processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect.events.clients import AssertingEventsClient
from prefect.events.worker import EventsWorker
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Failed

from lightning_core.errors import Conflict, InvalidInput, NotFound
from lightning_rl.registry import events as registry_events
from lightning_rl.registry import versions
from lightning_rl.registry.config import RegistryConfig, resolve
from lightning_rl.registry.connection import RegistryUnavailable
from lightning_rl.registry.events import PROMOTED_EVENT
from lightning_rl.registry.lock import RegistryBusy, promotion_lock
from lightning_rl.registry.names import (
    CHALLENGER,
    CHAMPION,
    TAG_BENCHMARK_ID,
    TAG_BENCHMARK_SIZE,
    TAG_DECISION,
    TAG_LOCK_EXPIRES,
    TAG_POLICY_VERSION,
    TAG_SCORE,
    score_tag,
)
from lightning_rl.registry.promotion import PromotionDecision, recorded_decision
from lightning_rl.registry.pyfunc import log_adapter_model
from lightning_rl.registry.runs import log_metrics, log_metrics_once, log_params, tracking
from lightning_rl.registry.versions import (
    champion_adapter,
    promote,
    record_score,
    register_policy_version,
)
from lightning_rl.tasks.registry import _transient

REPO = Path(__file__).resolve().parents[1]
BENCH = "0123456789abcdef"


def register(
    config: RegistryConfig,
    adapter: Path,
    policy_version: str,
    score: float,
    *,
    iteration: int = 1,
    benchmark: str = BENCH,
    run_id: str | None = None,
) -> PromotionDecision:
    return register_policy_version(
        config,
        adapter,
        base_model="tiny",
        policy_version=policy_version,
        iteration=iteration,
        score=score,
        benchmark_id=benchmark,
        benchmark_size=50,
        run_id=run_id,
    )


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> Path:
    # One database for the module: MLflow's first connection runs its migrations (seconds).
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture
def config(database, monkeypatch, request) -> RegistryConfig:
    # set_tracking_uri exports MLFLOW_TRACKING_URI; monkeypatch removes it after the test.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{database}")
    # The registry URI is a process global no variable unsets: left by an earlier test's flow,
    # it would point the tests' own `MlflowClient(tracking_uri)` at that test's registry.
    mlflow.set_registry_uri(f"sqlite:///{database}")
    return RegistryConfig(
        tracking_uri=f"sqlite:///{database}",
        registered_model=f"lightning-{request.node.name.removeprefix('test_')}",
        promotion_margin=0.02,
        promotion_threshold=0.3,
    )


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("adapter"))


def make_adapter(folder: Path) -> Path:
    """A real PEFT LoRA folder on the tiny Llama, plus an optimizer state as LoRATrainer writes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_core.algo.trainer import STATE_FILE
    from lightning_core.models import tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(folder)
    (folder / STATE_FILE).write_bytes(b"optimizer state")
    return folder


@pytest.fixture
def events(monkeypatch):
    """Prefect events caught in memory, as if a Prefect server were configured."""
    worker = EventsWorker.instance(AssertingEventsClient)
    monkeypatch.setattr(EventsWorker, "instance", lambda *_: worker)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        yield lambda: (worker.drain(), AssertingEventsClient.last.events)[1]
    worker.drain()


def test_tracking_logs_flattened_params_and_metrics_by_step(config):
    with tracking(config, run_name="flow-run-1", tags={"agent": "calc"}) as run:
        logged = log_params({"trainer": {"lora": {"rank": 8}, "learning_rate": 1e-5}, "seed": 0})
        for iteration in range(3):
            log_metrics({"train/loss": 1.0 / (iteration + 1), "eval/score": None}, step=iteration)
    assert logged == {"trainer.lora.rank": "8", "trainer.learning_rate": "1e-05", "seed": "0"}

    client = MlflowClient(config.tracking_uri)
    finished = client.get_run(run.info.run_id)
    assert finished.info.status == "FINISHED"
    assert finished.info.run_name == "flow-run-1"
    assert finished.data.tags["agent"] == "calc"
    assert finished.data.params == logged
    assert client.get_experiment(finished.info.experiment_id).name == config.experiment
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]
    assert client.get_metric_history(run.info.run_id, "eval/score") == []
    # Artifacts land beside the SQLite file unless told otherwise.
    assert finished.info.artifact_uri.startswith((config_dir(config) / "mlartifacts").as_uri())


def test_a_resumed_run_logs_each_step_once(config):
    with tracking(config, run_name="killed") as run:
        log_metrics_once({"train/loss": 1.0, "eval/score": 0.1}, step=1)
    # Resumed: step 1 is repeated (not checkpointed), then step 2 is new.
    with tracking(config, run_id=run.info.run_id):
        logged = log_metrics_once({"train/loss": 0.9, "eval/score": 0.2, "new": 1.0}, step=1)
        assert logged == {"new": 1.0}
        assert log_metrics_once({"train/loss": 0.8, "eval/score": None}, step=2) == {
            "train/loss": 0.8
        }
    client = MlflowClient(config.tracking_uri)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 0.8)]
    assert client.get_run(run.info.run_id).info.status == "FINISHED"


def test_resolve_fills_in_the_agents_registered_model():
    assert resolve(None, "lightning-calc").registered_model == "lightning-calc"
    unnamed = RegistryConfig(registered_model="", promotion_margin=0.1)
    assert resolve(unnamed, "lightning-calc") == unnamed.model_copy(
        update={"registered_model": "lightning-calc"}
    )
    named = RegistryConfig(registered_model="mine")
    assert resolve(named, "lightning-calc") is named


def config_dir(config: RegistryConfig) -> Path:
    return Path(config.tracking_uri.removeprefix("sqlite:///")).parent


def assert_in_experiment_artifacts(config: RegistryConfig, version: str | int) -> None:
    client = MlflowClient(config.tracking_uri)
    source = client.get_model_version_download_uri(config.registered_model, str(version))
    assert source.startswith((config_dir(config) / "mlartifacts").as_uri())


def test_gated_promotion_moves_the_champion_only_on_a_real_gain(config, adapter, events):
    client = MlflowClient(config.tracking_uri)
    name = config.registered_model

    def aliases() -> tuple[str | None, str | None]:
        return tuple(
            str(client.get_model_version_by_alias(name, alias).version)
            for alias in (CHAMPION, CHALLENGER)
        )

    with tracking(config, run_name="train") as run:
        log_metrics({"eval/score": 0.5}, step=1)
        first = register(config, adapter, "v1", 0.5, iteration=1)
        assert first.promote and first.champion_score is None and first.champion_version is None
        assert aliases() == ("1", "1")

        second = register(config, adapter, "v2", 0.6, iteration=2)
        assert second.promote and second.champion_score == 0.5 and second.champion_version == "1"
        assert aliases() == ("2", "2")

        third = register(config, adapter, "v3", 0.55, iteration=3)
        assert not third.promote and third.champion_score == 0.6
        assert aliases() == ("2", "3")

    v1, v2, v3 = (client.get_model_version(name, str(v)) for v in (1, 2, 3))
    assert v1.run_id == run.info.run_id
    assert v2.tags["policy_version"] == "v2" and v2.tags["iteration"] == "2"
    assert v2.tags["base_model"] == "tiny" and v2.tags["eval.score"] == "0.6"
    assert v2.tags[TAG_BENCHMARK_ID] == BENCH and v2.tags[TAG_BENCHMARK_SIZE] == "50"
    assert v2.tags["promotion.benchmark_id"] == BENCH
    assert v2.tags["promotion.decision"] == "promoted"
    assert v2.tags["promotion.champion_score"] == "0.5"
    assert v1.tags["promotion.champion_score"] == "none"
    assert v3.tags["promotion.decision"] == "rejected"
    assert v3.tags["promotion.champion_version"] == "2"
    assert "less than the margin" in v3.tags["promotion.reason"]
    # A version cannot beat itself.
    assert promote(config, 2).reason == "already the champion"

    promoted = events()
    assert [e.event for e in promoted] == [PROMOTED_EVENT, PROMOTED_EVENT]
    assert promoted[1].resource.id == f"mlflow.model.{name}.2"
    assert promoted[1].payload["champion_score"] == 0.5

    downloaded = champion_adapter(config)
    assert downloaded is not None and downloaded.version == "2" and downloaded.score == 0.6
    files = {p.name for p in downloaded.adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "trainer_state.pt" not in files  # the optimizer state stays out of the model
    assert champion_adapter(config, 3).score == 0.55
    assert champion_adapter(config, CHALLENGER).version == "3"
    assert champion_adapter(config, 9) is None
    assert champion_adapter(config, "nonexistent-alias") is None

    # The logged model is a working pyfunc: base model + adapter, answering a prompt.
    policy = mlflow.pyfunc.load_model(
        f"models:/{name}@{CHAMPION}", model_config={"max_new_tokens": 4}
    )
    (reply,) = policy.predict(["What is 2 + 2?"])
    assert isinstance(reply, str)


def test_no_champion_until_a_version_reaches_the_threshold(config, adapter):
    client = MlflowClient(config.tracking_uri)
    with tracking(config) as run, ThreadPoolExecutor(1) as pool:
        # As a Prefect task submitted to a thread would: the run is named, not active there.
        decision = pool.submit(
            register, config, adapter, "v1", 0.1, run_id=run.info.run_id
        ).result()
        assert client.get_run(run.info.run_id).info.status == "RUNNING"
    assert not decision.promote and "below threshold" in decision.reason
    assert decision.challenger_version == "1"
    version = client.get_model_version(config.registered_model, "1")
    assert str(version.run_id) == run.info.run_id
    assert_in_experiment_artifacts(config, version.version)
    assert champion_adapter(config) is None
    assert champion_adapter(config, CHALLENGER).version == "1"
    # Gated again, the same rule on the same registry decides the same.
    assert promote(config, 1) == decision


def test_a_failing_event_does_not_fail_the_promotion(config, adapter, monkeypatch, caplog):
    def broken(**_):
        raise RuntimeError("events server down")

    monkeypatch.setattr("prefect.events.emit_event", broken)
    monkeypatch.setattr(registry_events, "_should_emit_events", lambda: True)
    decision = register(config, adapter, "v1", 0.9)
    assert decision.promote
    assert champion_adapter(config).version == "1"
    assert_in_experiment_artifacts(config, "1")  # logged without any run
    assert "could not emit lightning.model.promoted" in caplog.text


def test_register_refuses_a_folder_that_is_no_adapter(config, tmp_path):
    with pytest.raises(InvalidInput, match=r"no adapter_config\.json"):
        register(config, tmp_path, "v1", 1.0)
    with pytest.raises(InvalidInput, match="no benchmark id"):
        register(config, tmp_path, "v1", 1.0, benchmark="")
    assert versions_of(config) == []


def versions_of(config: RegistryConfig) -> list[str]:
    client = MlflowClient(config.tracking_uri)
    found = client.search_model_versions(f"name = '{config.registered_model}'")
    return sorted(str(v.version) for v in found)


def test_registering_again_from_the_same_run_returns_the_first_decision(config, adapter, events):
    def again(policy_version: str, run_id: str | None = None) -> PromotionDecision:
        return register(config, adapter, policy_version, 0.5, run_id=run_id)

    with tracking(config, run_name="train") as run:
        first = again("v1")
    assert first.promote and first.challenger_version == "1"

    # The flow run is resumed after a crash: same MLflow run, the same policy version again.
    with tracking(config, run_id=run.info.run_id) as resumed:
        assert resumed.info.run_id == run.info.run_id
        assert again("v1") == first
    # From a task's thread, where the run is named rather than active.
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(again, "v1", run.info.run_id).result() == first
    assert versions_of(config) == ["1"]
    assert len(events()) == 1  # decided and announced once

    # Another policy version of the run is a version of its own: one whose name no filter can
    # quote (both quote characters) is still told apart from the others.
    odd = """it's "v2\""""
    with tracking(config, run_id=run.info.run_id):
        assert again(odd).challenger_version == "2"
        assert again(odd).challenger_version == "2"
    # And so is the same policy version from another run.
    with tracking(config, run_name="another") as other:
        third = again("v1")
    assert third.challenger_version == "3" and not third.promote
    assert versions_of(config) == ["1", "2", "3"]
    client = MlflowClient(config.tracking_uri)
    assert str(client.get_model_version(config.registered_model, "3").run_id) == other.info.run_id
    assert str(client.get_model_version_by_alias(config.registered_model, CHAMPION).version) == "1"


def test_registering_again_finishes_a_registration_cut_short(config, adapter, monkeypatch):
    client = MlflowClient(config.tracking_uri)
    name = config.registered_model

    with tracking(config) as run:
        # Registered, never decided: what an earlier release left when cut short before its
        # promotion (versions are now created with their decision).
        tags = {TAG_POLICY_VERSION: "v1", TAG_SCORE: "0.5", TAG_BENCHMARK_ID: BENCH}
        logged = log_adapter_model(adapter, base_model="tiny", tags=tags, step=1)
        mlflow.register_model(logged.model_uri, name, tags=logged.tags)
        assert TAG_DECISION not in client.get_model_version(name, "1").tags
        decision = register(config, adapter, "v1", 0.5)
    assert decision.promote and decision.challenger_version == "1"
    assert versions_of(config) == ["1"]

    # Cut short between creating the version (with its decision) and moving the champion.
    def killed(*_):
        raise ConnectionError("killed")

    with tracking(config, run_id=run.info.run_id):
        with monkeypatch.context() as patch:
            patch.setattr(versions, "move_champion", killed)
            with pytest.raises(ConnectionError):
                register(config, adapter, "v2", 0.9, iteration=2)
        v2 = client.get_model_version(name, "2").tags
        assert v2[TAG_DECISION] == "promoted" and v2[TAG_SCORE] == "0.9"
        assert v2[TAG_BENCHMARK_ID] == BENCH
        assert str(client.get_model_version_by_alias(name, CHAMPION).version) == "1"

        resumed = register(config, adapter, "v2", 0.9, iteration=2)
    assert resumed.promote and (resumed.challenger_version, resumed.champion_version) == ("2", "1")
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == "2"
    assert versions_of(config) == ["1", "2"]
    # Once moved, a further repeat leaves the champion be.
    with tracking(config, run_id=run.info.run_id):
        assert register(config, adapter, "v2", 0.9, iteration=2) == resumed
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == "2"


def test_the_register_task_retries_all_but_invalid_input():
    assert not _transient(None, None, Failed(data=InvalidInput("no adapter_config.json")))
    assert _transient(None, None, Failed(data=ConnectionError("tracking server down")))
    assert _transient(None, None, Failed(data=TimeoutError("timed out after 900 s")))
    assert _transient(None, None, Failed(data=RegistryUnavailable("tracking server down")))
    assert _transient(None, None, Failed(data=RegistryBusy("lock held")))


def test_a_score_from_another_benchmark_is_never_compared(config, adapter):
    client = MlflowClient(config.tracking_uri)
    name = config.registered_model
    other = "fedcba9876543210"
    assert register(config, adapter, "v1", 0.35, benchmark=other).promote

    # 0.9 here against 0.35 there would pass any margin: it is not compared, the champion stays.
    refused = register(config, adapter, "v2", 0.9)
    assert not refused.promote
    assert (refused.champion_version, refused.champion_score) == ("1", None)
    assert f"no score on benchmark {BENCH}" in refused.reason
    assert "`lightning-rl eval --policy champion --eval-size 50`" in refused.reason
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == "1"

    # What `lightning-rl eval --policy champion` records: the champion's score on BENCH, beside
    # (not over) the score it was registered with.
    assert record_score(config, CHAMPION, 0.6, BENCH, 50) == "1"
    champion_tags = client.get_model_version(name, "1").tags
    assert champion_tags[score_tag(BENCH)] == "0.6" and champion_tags[TAG_SCORE] == "0.35"

    # Now the next promotion compares, on BENCH: 0.65 against 0.6.
    compared = register(config, adapter, "v3", 0.65)
    assert compared.promote and (compared.champion_version, compared.champion_score) == ("1", 0.6)
    # And v2, gated again, against the new champion's 0.65 there.
    again = promote(config, 2)
    assert again.promote and (again.champion_version, again.champion_score) == ("3", 0.65)
    assert recorded_decision("2", client.get_model_version(name, "2").tags) == again


def lock_tickets(config: RegistryConfig) -> list[str]:
    client = MlflowClient(config.tracking_uri)
    lock = f"{config.registered_model}.promotion-lock"
    return sorted(str(v.version) for v in client.search_model_versions(f"name = '{lock}'"))


def child(**args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.registry_child", json.dumps(args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # two processes importing MLflow and torch: 20-50 s here
def test_two_processes_registering_together_leave_one_champion_and_consistent_tags(
    config, adapter, tmp_path
):
    client = MlflowClient(config.tracking_uri)
    name = config.registered_model
    assert register(config, adapter, "v1", 0.5).promote
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    # Both beat the champion's 0.5 by the margin: unserialised, both would be decided against
    # it, both promoted, and the champion would be whichever moved the alias last.
    children = [
        child(
            do="register",
            config=config.model_dump(),
            adapter=str(adapter),
            policy_version=f"p{score}",
            score=score,
            benchmark_id=BENCH,
            barrier=str(barrier),
            peers=2,
        )
        for score in (0.6, 0.7)
    ]
    outputs = [process.communicate(timeout=240) for process in children]
    for process, (_, err) in zip(children, outputs, strict=True):
        assert process.returncode == 0, err[-3000:]
    decisions = [PromotionDecision.model_validate_json(out.splitlines()[-1]) for out, _ in outputs]

    # Versions are created under the lock, so their numbers are the order it was held in.
    first, second = sorted(decisions, key=lambda d: int(d.challenger_version))
    assert first.promote and first.champion_version == "1"
    # The later decision was made against the earlier one's outcome.
    assert (second.champion_version, second.champion_score) == (
        first.challenger_version,
        first.challenger_score,
    )
    best = max(decisions, key=lambda d: d.challenger_score)
    assert best.challenger_score == 0.7
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == best.challenger_version
    assert second.promote is (second is best)
    # Searches leave aliases out: each version read by itself.
    found = [client.get_model_version(name, v) for v in versions_of(config)]
    assert len(found) == 3 and sum(CHAMPION in v.aliases for v in found) == 1
    for decision in decisions:
        tags = client.get_model_version(name, decision.challenger_version).tags
        assert recorded_decision(decision.challenger_version, tags) == decision
    assert lock_tickets(config) == []  # both released


def test_an_expired_lock_is_taken_over(config):
    client = MlflowClient(config.tracking_uri)
    name = config.registered_model
    holder = child(do="hold", uri=config.tracking_uri, name=name, ttl_s=2.0)
    try:
        held = json.loads(holder.stdout.readline() or "{}")
        assert "ticket" in held, holder.stderr.read()[-3000:]
    finally:
        holder.kill()  # crashed while holding: its ticket stays behind
        holder.wait(timeout=30)
    lock = f"{name}.promotion-lock"
    expires = float(client.get_model_version(lock, held["ticket"]).tags[TAG_LOCK_EXPIRES])

    with promotion_lock(client, name, ttl_s=60, wait_s=60) as ticket:
        taken = time.time()
        assert lock_tickets(config) == [ticket.version]  # the dead one passed and deleted
    assert expires <= taken < expires + 30
    assert int(ticket.version) > int(held["ticket"])
    assert lock_tickets(config) == []


def test_a_held_lock_fails_a_waiter_clearly_after_its_wait(config):
    client = MlflowClient(config.tracking_uri)
    name = config.registered_model
    with promotion_lock(client, name, ttl_s=60, wait_s=0) as holder:
        started = time.monotonic()
        busy = pytest.raises(RegistryBusy, match=rf"waited 0.5 s .* held by {holder.owner}")
        with busy, promotion_lock(client, name, ttl_s=60, wait_s=0.5):
            pass
        assert 0.5 <= time.monotonic() - started < 10
        assert lock_tickets(config) == [holder.version]  # the waiter's ticket went with it
    # A holder whose ticket was passed (it overran its lease) writes nothing more.
    with promotion_lock(client, name, ttl_s=60, wait_s=0) as ticket:
        client.delete_model_version(f"{name}.promotion-lock", ticket.version)
        with pytest.raises(RegistryBusy, match="taken over"):
            ticket.renew()
    assert lock_tickets(config) == []


def test_the_live_gate_second_canaries_announces_and_rolls_back_in_one_step(
    config, adapter, events
):
    """With registry.live_gate, a version past the offline gate goes to a canary (challenger
    only, tagged canary, an event for automations); the first champion is promoted at once; a
    rollback returns to the champion before, recorded with its reason and announced."""
    from lightning_rl.registry.events import (
        CANARY_ENDED_EVENT,
        CANARY_STARTED_EVENT,
        ROLLED_BACK_EVENT,
    )
    from lightning_rl.registry.live import decide_canary, rollback

    live = config.model_copy(update={"live_gate": True})
    name = config.registered_model
    client = MlflowClient(config.tracking_uri)
    assert register(live, adapter, "v1", 0.5).promote  # nothing to compare live with yet
    second = register(live, adapter, "v2", 0.6)
    assert second.canary and not second.promote and "live gate decides" in second.reason
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == "1"
    assert str(client.get_model_version_by_alias(name, CHALLENGER).version) == "2"
    assert client.get_model_version(name, "2").tags["promotion.decision"] == "canary"
    v3 = register(live, adapter, "v3", 0.51)  # under the margin: rejected offline
    assert not (v3.promote or v3.canary)
    # ...and it does not end v2's canary, which live traffic is deciding.
    assert str(client.get_model_version_by_alias(name, CHALLENGER).version) == "2"
    with pytest.raises(NotFound, match="first champion"):
        rollback(live, "nothing before v1")

    # A newer canary replaces v2's; decisions on v2 are then refused. v4's canary is promoted
    # by the live gate, then rolled back by hand.
    assert register(live, adapter, "v4", 0.7).canary
    assert decide_canary(live, "2", True, "better live") is False
    assert decide_canary(live, "4", True, "challenger better by +0.3")
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == "4"
    with pytest.raises(Conflict):
        rollback(live, "stale decision", expected="1")
    assert rollback(live, "users report wrong totals", expected="4") == ("4", "1")
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == "1"
    assert (
        "users report wrong totals" in client.get_model_version(name, "4").tags["rollback.reason"]
    )
    assert register(live, adapter, "v5", 0.8).canary
    assert decide_canary(live, "5", False, "challenger worse by -0.4")
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(name, CHALLENGER)
    kinds = [e.event for e in events()]
    assert kinds.count(CANARY_STARTED_EVENT) == 3
    assert kinds[-2:] == [CANARY_STARTED_EVENT, CANARY_ENDED_EVENT]
    assert ROLLED_BACK_EVENT in kinds and kinds.count(PROMOTED_EVENT) == 2
