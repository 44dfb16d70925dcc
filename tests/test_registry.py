"""The MLflow registry with gated promotion: the pure gate, then real MLflow on a SQLite file."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest
from lightning_rl.tasks import registry
from lightning_rl.tasks.registry import (
    CHALLENGER,
    CHAMPION,
    PROMOTED_EVENT,
    RegistryConfig,
    champion_adapter,
    decide_promotion,
    log_metrics,
    log_params,
    promote,
    publish_adapter,
    register_adapter,
    tracking,
)
from mlflow import MlflowClient
from prefect.events.clients import AssertingEventsClient
from prefect.events.worker import EventsWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from lightning_core.errors import InvalidInput


@pytest.mark.parametrize(
    ("challenger", "champion", "promote_it"),
    [
        (0.5, None, True),  # no champion, above the threshold
        (0.3, None, True),  # no champion, exactly at the threshold
        (0.2, None, False),  # no champion, below the threshold
        (0.75, 0.70, True),  # gain above the margin
        (0.72, 0.70, True),  # gain of exactly the margin, despite 0.72 - 0.70 < 0.02 in floats
        (0.71, 0.70, False),  # gain below the margin
        (0.60, 0.70, False),  # worse
    ],
)
def test_decide_promotion(challenger, champion, promote_it):
    decision = decide_promotion(challenger, champion, margin=0.02, threshold=0.3)
    assert decision.promote is promote_it
    assert decision.challenger_score == challenger
    assert decision.champion_score == champion
    assert str(challenger) in decision.reason


def test_decide_promotion_refuses_a_missing_score():
    with pytest.raises(InvalidInput, match="nan"):
        decide_promotion(float("nan"), 0.5, margin=0.02, threshold=0.0)


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> Path:
    # One database for the module: MLflow's first connection runs its migrations (seconds).
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture
def config(database, monkeypatch, request) -> RegistryConfig:
    # set_tracking_uri exports MLFLOW_TRACKING_URI; monkeypatch removes it after the test.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{database}")
    return RegistryConfig(
        tracking_uri=f"sqlite:///{database}",
        registered_model=f"lightning-{request.node.name.removeprefix('test_')}",
        promotion_margin=0.02,
        promotion_threshold=0.3,
    )


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A real PEFT LoRA folder on the tiny Llama, plus an optimizer state as LoRATrainer writes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_core.algo.trainer import STATE_FILE
    from lightning_core.models import tiny_model_dir

    folder = tmp_path_factory.mktemp("adapter")
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
        first = publish_adapter(
            config, adapter, base_model="tiny", policy_version="v1", iteration=1, score=0.5
        )
        assert first.promote and first.champion_score is None and first.champion_version is None
        assert aliases() == ("1", "1")

        second = publish_adapter(
            config, adapter, base_model="tiny", policy_version="v2", iteration=2, score=0.6
        )
        assert second.promote and second.champion_score == 0.5 and second.champion_version == "1"
        assert aliases() == ("2", "2")

        third = publish_adapter(
            config, adapter, base_model="tiny", policy_version="v3", iteration=3, score=0.55
        )
        assert not third.promote and third.champion_score == 0.6
        assert aliases() == ("2", "3")

    v1, v2, v3 = (client.get_model_version(name, str(v)) for v in (1, 2, 3))
    assert v1.run_id == run.info.run_id
    assert v2.tags["policy_version"] == "v2" and v2.tags["iteration"] == "2"
    assert v2.tags["base_model"] == "tiny" and v2.tags["eval.score"] == "0.6"
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
    with tracking(config) as run, ThreadPoolExecutor(1) as pool:
        # As a Prefect task submitted to a thread would: the run is named, not active there.
        version = pool.submit(
            register_adapter,
            config,
            adapter,
            base_model="tiny",
            policy_version="v1",
            iteration=1,
            score=0.1,
            run_id=run.info.run_id,
        ).result()
        client = MlflowClient(config.tracking_uri)
        assert client.get_run(run.info.run_id).info.status == "RUNNING"
    assert str(version.run_id) == run.info.run_id
    assert_in_experiment_artifacts(config, version.version)
    decision = promote(config, version.version)
    assert not decision.promote and "below threshold" in decision.reason
    assert champion_adapter(config) is None
    assert champion_adapter(config, CHALLENGER).version == "1"
    assert str(version.version) == "1"


def test_a_failing_event_does_not_fail_the_promotion(config, adapter, monkeypatch, caplog):
    def broken(**_):
        raise RuntimeError("events server down")

    monkeypatch.setattr("prefect.events.emit_event", broken)
    monkeypatch.setattr(registry, "_should_emit_events", lambda: True)
    decision = publish_adapter(
        config, adapter, base_model="tiny", policy_version="v1", iteration=1, score=0.9
    )
    assert decision.promote
    assert champion_adapter(config).version == "1"
    assert_in_experiment_artifacts(config, "1")  # logged without any run
    assert "could not emit lightning.model.promoted" in caplog.text


def test_register_refuses_a_folder_that_is_no_adapter(config, tmp_path):
    with pytest.raises(InvalidInput, match=r"no adapter_config\.json"):
        register_adapter(
            config, tmp_path, base_model="tiny", policy_version="v1", iteration=0, score=1.0
        )
