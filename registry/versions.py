"""The registered model's versions: registering a trained adapter as one, gated into the
`champion` alias, and finding and downloading a version again.

Each trained adapter is logged as a pyfunc model of the flow's MLflow run (pyfunc.py) and
registered as a new version of one registered model, which the alias `challenger` then points
at. The alias `champion` (what evaluation and serving pick up) moves to it only past the
promotion rule (promotion.py), which compares scores on the same benchmark only.

Promotions of a registered model are serialised by the promotion lock (lock.py): under it, the
champion and its score are read, the rule decides, and the version is created with its score,
benchmark and decision tags in one request, so that no version is ever seen without them; then
the aliases move. Two registrations finishing together leave the second decided against the
first's outcome.

Registration is idempotent per (MLflow run, policy version): a flow run resumed after a crash,
or a retried task, that registers the same policy version from the same run again gets the
version (and the decision) of the first time, not a second version, and finishes the alias
moves the first time was cut short before.
"""

from __future__ import annotations

import logging
import math
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

import mlflow
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    RESOURCE_DOES_NOT_EXIST,
    ErrorCode,
)

from lightning_core.errors import InvalidInput, NotFound
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import (
    experiment_id,
    filter_literal,
    mlflow_client,
    reachable,
)
from lightning_rl.registry.events import CANARY_STARTED_EVENT, emit_promoted, emit_registry_event
from lightning_rl.registry.history import push_champion
from lightning_rl.registry.lock import Ticket, promotion_lock
from lightning_rl.registry.names import (
    CANARY,
    CHALLENGER,
    CHAMPION,
    TAG_BASE_MODEL,
    TAG_BENCHMARK_ID,
    TAG_BENCHMARK_SIZE,
    TAG_DECISION,
    TAG_ITERATION,
    TAG_POLICY_VERSION,
    TAG_SCORE,
    benchmark_size_tag,
    score_tag,
)
from lightning_rl.registry.promotion import (
    PromotionDecision,
    benchmark_score,
    decide_version,
    decision_tags,
    recorded_decision,
    through_canary,
)
from lightning_rl.registry.pyfunc import ADAPTER_ARTIFACT, log_adapter_model

logger = logging.getLogger(__name__)


# --- what a score is --------------------------------------------------------------------------


def _check_score(score: float, benchmark_id: str, benchmark_size: int) -> None:
    if not math.isfinite(score):
        raise InvalidInput(f"the adapter's score is {score}; evaluation must give a number")
    if not benchmark_id:
        raise InvalidInput(
            "the score has no benchmark id, so it cannot be compared with any other; evaluate "
            "the policy again (EvalResult.benchmark_id names the benchmark it was scored on)"
        )
    if benchmark_size < 1:
        raise InvalidInput(f"the benchmark has {benchmark_size} tasks; a score needs at least 1")


def _score_tags(score: float, benchmark_id: str, benchmark_size: int) -> dict[str, str]:
    return {
        TAG_SCORE: repr(float(score)),
        TAG_BENCHMARK_ID: benchmark_id,
        TAG_BENCHMARK_SIZE: str(benchmark_size),
    }


def _score(model_version: ModelVersion) -> float | None:
    """The score `model_version` was registered with (on its TAG_BENCHMARK_ID benchmark)."""
    try:
        return float(model_version.tags[TAG_SCORE])
    except (KeyError, ValueError):
        return None


# --- the registry as it stands ----------------------------------------------------------------


def _active_run_id(run_id: str | None) -> str | None:
    if run_id is not None:
        return run_id
    active = mlflow.active_run()
    return None if active is None else active.info.run_id


def registered_version(
    client: MlflowClient, name: str, run_id: str, policy_version: str
) -> ModelVersion | None:
    """The version of `name` registered from MLflow run `run_id` for `policy_version` (its
    TAG_POLICY_VERSION tag), if any; the first one, should a race have made two."""
    wanted = {"name": name, "run_id": run_id, f"tags.{TAG_POLICY_VERSION}": policy_version}
    clauses = [f"{key} = {q}" for key, value in wanted.items() if (q := filter_literal(value))]
    # Checked again here: for values no filter could quote, and so that nothing but an exact
    # match ever counts as this registration.
    found = [
        v
        for v in client.search_model_versions(" AND ".join(clauses))
        if (v.name, v.run_id, v.tags.get(TAG_POLICY_VERSION)) == (name, run_id, policy_version)
    ]
    return min(found, key=lambda v: int(v.version), default=None)


def version_by_alias(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        # A missing model is RESOURCE_DOES_NOT_EXIST, a missing alias INVALID_PARAMETER_VALUE.
        missing = (ErrorCode.Name(RESOURCE_DOES_NOT_EXIST), ErrorCode.Name(INVALID_PARAMETER_VALUE))
        if e.error_code in missing and "not found" in e.message:
            return None
        raise


def _lookup(client: MlflowClient, name: str, ref: str) -> ModelVersion | None:
    """Version `ref` (a number) or the version alias `ref` points at; None if there is none."""
    if not ref.isdigit():
        return version_by_alias(client, name, ref)
    try:
        return client.get_model_version(name, ref)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        return None


def registry_lock(client: MlflowClient, config: RegistryConfig) -> AbstractContextManager[Ticket]:
    return promotion_lock(client, config.registered_model, config.lock_ttl_s, config.lock_wait_s)


# --- deciding (under the lock) ----------------------------------------------------------------


def _decide(
    client: MlflowClient,
    config: RegistryConfig,
    challenger_version: str | None,
    score: float,
    benchmark_id: str,
    benchmark_size: int | None,
) -> PromotionDecision:
    """The rule on the champion as the registry has it now, and its score on this benchmark."""
    champion = version_by_alias(client, config.registered_model, CHAMPION)
    # ModelVersion.version is an int from the SQLite store though typed str: normalise.
    decision = decide_version(
        challenger_version,
        score,
        None if champion is None else str(champion.version),
        None if champion is None else benchmark_score(champion.tags, benchmark_id),
        config.promotion_margin,
        config.promotion_threshold,
        benchmark_id=benchmark_id,
        benchmark_size=benchmark_size,
    )
    return through_canary(decision) if config.live_gate else decision


def move_champion(client: MlflowClient, name: str, decision: PromotionDecision) -> None:
    """Point `champion` at the decision's version (under the promotion lock), remembering the
    one it leaves for a rollback, and tell Prefect."""
    push_champion(client, name, decision.champion_version)
    client.set_registered_model_alias(name, CHAMPION, str(decision.challenger_version))
    emit_promoted(name, decision)


def _point_challenger(
    client: MlflowClient, name: str, version: str, canary: bool | None = None
) -> None:
    """Alias `challenger` to `version` unless a later version has it: it names the latest.
    Except that a version in canary (tagged so by the live gate's first gate) keeps it against
    a newer one that is not (`canary` False): a version rejected offline must not end a canary
    that live traffic is deciding."""
    current = version_by_alias(client, name, CHALLENGER)
    if current is not None and int(current.version) > int(version):
        return
    if canary is False and current is not None and current.tags.get(TAG_DECISION) == CANARY:
        return
    client.set_registered_model_alias(name, CHALLENGER, version)


def _log(name: str, decision: PromotionDecision) -> None:
    tags = decision_tags(decision)
    logger.info(
        "%s v%s: %s (%s)", name, decision.challenger_version, tags[TAG_DECISION], decision.reason
    )


def _gate(client: MlflowClient, config: RegistryConfig, version: ModelVersion) -> PromotionDecision:
    """Decide on a registered version again, record it on its tags, move the champion if so."""
    name = config.registered_model
    score, benchmark = _score(version), version.tags.get(TAG_BENCHMARK_ID)
    if score is None or not benchmark:
        raise InvalidInput(
            f"{name} v{version.version} has no numeric {TAG_SCORE} tag with its "
            f"{TAG_BENCHMARK_ID}; register versions with register_policy_version, which "
            "records both, or set the tags"
        )
    size = version.tags.get(TAG_BENCHMARK_SIZE)
    decision = _decide(
        client,
        config,
        str(version.version),
        score,
        benchmark,
        int(size) if size and size.isdigit() else None,
    )
    for key, value in decision_tags(decision).items():
        client.set_model_version_tag(name, str(version.version), key, value)
    if decision.promote:
        move_champion(client, name, decision)
    _log(name, decision)
    return decision


def _finish(
    client: MlflowClient, config: RegistryConfig, version: ModelVersion
) -> PromotionDecision:
    """A registration found done before: complete what it was cut short of (the aliases), or
    decide on it if it never was (registered before decisions were made at registration)."""
    name = config.registered_model
    _point_challenger(client, name, str(version.version))
    recorded = recorded_decision(str(version.version), version.tags)
    if recorded is None:
        return _gate(client, config, version)
    if recorded.promote:
        champion = version_by_alias(client, name, CHAMPION)
        # Moved only if it still is where the decision found it: a champion moved since (by a
        # later promotion, or by hand) stays where it is.
        if (None if champion is None else str(champion.version)) == recorded.champion_version:
            move_champion(client, name, recorded)
    logger.info("%s v%s: registered before; %s", name, version.version, recorded.reason)
    return recorded


# --- registering and promoting ----------------------------------------------------------------


def register_policy_version(
    config: RegistryConfig,
    adapter: str | Path,
    *,
    base_model: str,
    policy_version: str,
    iteration: int,
    score: float,
    benchmark_id: str,
    benchmark_size: int,
    run_id: str | None = None,
) -> PromotionDecision:
    """Register the adapter as a new model version (alias challenger), gated into champion:
    what a training flow does at its end.

    `adapter` is one PEFT adapter folder, or a folder of one per agent (`<adapter>/<agent>/`),
    registered together as one version (tagged with its agents). `score` is its held-out score
    on benchmark `benchmark_id` of `benchmark_size` tasks (EvalResult). `run_id` None is this
    thread's active run (or no run). The version's tags record the policy version, iteration,
    base model, score, benchmark and the decision, all written as the version is created.

    Idempotent per (MLflow run, policy version): a repeat returns the decision recorded on the
    version the first time, completing what the first call did not (the alias moves), and never
    decides twice. Without any run there is nothing to recognise a repeat by, and each call
    registers a new version.
    """
    _check_score(score, benchmark_id, benchmark_size)
    client = mlflow_client(config)
    with reachable(client.tracking_uri, f"registering {policy_version}"):
        name = config.registered_model
        # The logged model joins the active experiment, not its run's: without this, a call
        # from a thread without the active run (or without any run) would file it under Default.
        mlflow.set_experiment(experiment_id=experiment_id(client, config))
        key = _active_run_id(run_id)
        existing = None if key is None else registered_version(client, name, key, policy_version)
        if existing is not None:
            if _score(existing) != float(score):
                logger.warning(
                    "%s v%s was registered for %s by run %s with score %s; keeping it, not %r",
                    name,
                    existing.version,
                    policy_version,
                    key,
                    existing.tags.get(TAG_SCORE),
                    score,
                )
            with registry_lock(client, config):
                return _finish(client, config, existing)
        tags = {
            TAG_POLICY_VERSION: policy_version,
            TAG_ITERATION: str(iteration),
            TAG_BASE_MODEL: base_model,
            **_score_tags(score, benchmark_id, benchmark_size),
        }
        # Outside the lock: uploading the adapter takes seconds, deciding a fraction of one.
        logged = log_adapter_model(
            adapter, base_model=base_model, tags=tags, step=iteration, run_id=run_id
        )
        with registry_lock(client, config) as ticket:
            decision = _decide(client, config, None, score, benchmark_id, benchmark_size)
            ticket.renew()
            registered = mlflow.register_model(
                logged.model_uri, name, tags={**logged.tags, **decision_tags(decision)}
            )
            version = str(registered.version)
            decision = decision.model_copy(update={"challenger_version": version})
            _point_challenger(client, name, version, decision.canary or decision.promote)
            if decision.promote:
                move_champion(client, name, decision)
            elif decision.canary:
                payload = decision.model_dump(mode="json")
                emit_registry_event(CANARY_STARTED_EVENT, name, version, payload)
        _log(name, decision)
        return decision


def promote(config: RegistryConfig, model_version: str | int) -> PromotionDecision:
    """Gate registered version `model_version` again against the current champion, on the
    benchmark of its score (say, once the champion has a score there).

    On promotion the alias `champion` moves to it and a `lightning.model.promoted` event is
    emitted; either way the decision, reason and both scores replace those on its tags.
    """
    client = mlflow_client(config)
    with (
        reachable(client.tracking_uri, f"promoting v{model_version}"),
        registry_lock(client, config),
    ):
        candidate = client.get_model_version(config.registered_model, str(model_version))
        return _gate(client, config, candidate)


def record_score(
    config: RegistryConfig,
    ref: str | int,
    score: float,
    benchmark_id: str,
    benchmark_size: int,
) -> str:
    """Record on a registered version (a number, or an alias such as champion) its score on a
    benchmark, so that promotions of versions scored there can compare with it. Returns the
    version. The score it was registered with stays as it is: recorded again here only when it
    was on another benchmark."""
    _check_score(score, benchmark_id, benchmark_size)
    client = mlflow_client(config)
    name = config.registered_model
    with reachable(client.tracking_uri, f"recording a score of {name} {ref}"):
        found = _lookup(client, name, str(ref))
        if found is None:
            raise NotFound(f"registered model {name!r} has no version {ref!r}")
        version = str(found.version)
        if found.tags.get(TAG_BENCHMARK_ID) != benchmark_id:
            client.set_model_version_tag(name, version, score_tag(benchmark_id), repr(score))
            client.set_model_version_tag(
                name, version, benchmark_size_tag(benchmark_id), str(benchmark_size)
            )
        return version


# --- reading it back --------------------------------------------------------------------------


class RegisteredAdapter(NamedTuple):
    """A registered version's adapter, downloaded: what an evaluation of it needs."""

    version: str
    adapter: Path
    score: float | None


def champion_adapter(
    config: RegistryConfig, ref: str | int = CHAMPION, dst: str | Path | None = None
) -> RegisteredAdapter | None:
    """Download the adapter of the champion (or of a version number or another alias).

    None when the alias points nowhere or the model has no such version yet. `dst` None
    downloads into a new temporary folder. A version with one adapter per agent downloads as a
    folder of them, which publish_policy (tasks/training.py) serves per agent as it was trained.
    """
    client = mlflow_client(config)
    name = config.registered_model
    model_version = _lookup(client, name, str(ref))
    if model_version is None:
        return None
    target = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix="lightning-champion-"))
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{name}/{model_version.version}/artifacts/{ADAPTER_ARTIFACT}",
        dst_path=str(target),
    )
    return RegisteredAdapter(str(model_version.version), Path(local), _score(model_version))
