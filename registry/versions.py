"""The registered model's versions: registering a trained adapter as one, gating it into the
`champion` alias, and finding and downloading a version again.

Each trained adapter is logged as a pyfunc model of the flow's MLflow run (pyfunc.py) and
registered as a new version of one registered model, which the alias `challenger` then points
at. The alias `champion` (what evaluation and serving pick up) moves to it only past the
promotion rule (promotion.py); every decision is written on the version's tags, so the
registry alone tells why each version was or was not promoted.

Registration is idempotent per (MLflow run, policy version): a flow run resumed after a crash,
or a retried task, that registers the same policy version from the same run again gets the
version (and the decision) of the first time, not a second version.
"""

from __future__ import annotations

import logging
import math
import tempfile
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

from lightning_core.errors import InvalidInput
from lightning_rl.registry.config import RegistryConfig
from lightning_rl.registry.connection import experiment_id, mlflow_client
from lightning_rl.registry.events import emit_promoted
from lightning_rl.registry.names import (
    CHALLENGER,
    CHAMPION,
    TAG_BASE_MODEL,
    TAG_DECISION,
    TAG_ITERATION,
    TAG_POLICY_VERSION,
    TAG_SCORE,
)
from lightning_rl.registry.promotion import (
    PromotionDecision,
    decide_version,
    decision_tags,
    recorded_decision,
)
from lightning_rl.registry.pyfunc import ADAPTER_ARTIFACT, log_adapter_model

logger = logging.getLogger(__name__)


# --- registering ------------------------------------------------------------------------------


def _active_run_id(run_id: str | None) -> str | None:
    if run_id is not None:
        return run_id
    active = mlflow.active_run()
    return None if active is None else active.info.run_id


def _literal(value: str) -> str | None:
    # MLflow's filter strings have no escapes inside quotes: a value holding both quote
    # characters cannot be written, and is matched in Python instead.
    for quote in ("'", '"'):
        if quote not in value:
            return f"{quote}{value}{quote}"
    return None


def registered_version(
    client: MlflowClient, name: str, run_id: str, policy_version: str
) -> ModelVersion | None:
    """The version of `name` registered from MLflow run `run_id` for `policy_version` (its
    TAG_POLICY_VERSION tag), if any; the first one, should a race have made two."""
    wanted = {"name": name, "run_id": run_id, f"tags.{TAG_POLICY_VERSION}": policy_version}
    clauses = [f"{key} = {q}" for key, value in wanted.items() if (q := _literal(value))]
    # Checked again here: for values no filter could quote, and so that nothing but an exact
    # match ever counts as this registration.
    found = [
        v
        for v in client.search_model_versions(" AND ".join(clauses))
        if (v.name, v.run_id, v.tags.get(TAG_POLICY_VERSION)) == (name, run_id, policy_version)
    ]
    return min(found, key=lambda v: int(v.version), default=None)


def register_adapter(
    config: RegistryConfig,
    adapter: str | Path,
    *,
    base_model: str,
    policy_version: str,
    iteration: int,
    score: float,
    run_id: str | None = None,
) -> ModelVersion:
    """Log the adapter as a model of the run, register it as a new version, make it challenger.

    `adapter` is one PEFT adapter folder, or a folder of one per agent (`<adapter>/<agent>/`),
    registered together as one version (tagged with its agents). `run_id` None is this thread's
    active run (or no run); the version's tags record the policy version, iteration, base model
    and held-out score. The returned version's `.version` is an int with the SQLite store, though
    MLflow types it str.

    Within a run, a policy version is registered once: called again with the same run and
    policy version, this returns the version registered the first time (aliasing it challenger
    again only if its promotion was never decided, as the first call was cut short). Without
    any run there is nothing to recognise a repeat by, and each call registers a new version.
    """
    if not math.isfinite(score):
        raise InvalidInput(f"the adapter's score is {score}; evaluation must give a number")
    client = mlflow_client(config)
    name = config.registered_model
    # The logged model joins the active experiment, not its run's: without this, a call from a
    # thread without the active run (or without any run) would file it under Default.
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
        if recorded_decision(str(existing.version), existing.tags) is None:
            client.set_registered_model_alias(name, CHALLENGER, str(existing.version))
        return existing
    tags = {
        TAG_POLICY_VERSION: policy_version,
        TAG_ITERATION: str(iteration),
        TAG_BASE_MODEL: base_model,
        TAG_SCORE: repr(float(score)),
    }
    logged = log_adapter_model(
        adapter, base_model=base_model, tags=tags, step=iteration, run_id=run_id
    )
    registered = mlflow.register_model(logged.model_uri, name, tags=logged.tags)
    client.set_registered_model_alias(name, CHALLENGER, str(registered.version))
    return registered


# --- promoting --------------------------------------------------------------------------------


def _version_by_alias(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        # A missing model is RESOURCE_DOES_NOT_EXIST, a missing alias INVALID_PARAMETER_VALUE.
        missing = (ErrorCode.Name(RESOURCE_DOES_NOT_EXIST), ErrorCode.Name(INVALID_PARAMETER_VALUE))
        if e.error_code in missing and "not found" in e.message:
            return None
        raise


def _score(model_version: ModelVersion) -> float | None:
    try:
        return float(model_version.tags[TAG_SCORE])
    except (KeyError, ValueError):
        return None


def _move_champion(client: MlflowClient, name: str, decision: PromotionDecision) -> None:
    client.set_registered_model_alias(name, CHAMPION, str(decision.challenger_version))
    emit_promoted(name, decision)


def promote(config: RegistryConfig, model_version: str | int) -> PromotionDecision:
    """Gate `model_version` (scored by its `eval.score` tag) against the current champion.

    On promotion the alias `champion` moves to it and a `lightning.model.promoted` event is
    emitted; either way the decision, reason and both scores are tagged on the version.
    """
    client = mlflow_client(config)
    name = config.registered_model
    candidate = client.get_model_version(name, str(model_version))
    score = _score(candidate)
    if score is None:
        raise InvalidInput(
            f"{name} v{candidate.version} has no numeric {TAG_SCORE} tag; register it with "
            "register_adapter (which records the score) or set the tag"
        )
    champion = _version_by_alias(client, name, CHAMPION)
    # ModelVersion.version is an int from the SQLite store though typed str: normalise.
    decision = decide_version(
        str(candidate.version),
        score,
        None if champion is None else str(champion.version),
        None if champion is None else _score(champion),
        config.promotion_margin,
        config.promotion_threshold,
    )
    # The tags first: they record the decision, and a repeat of the registration that finds
    # them finishes the alias move if it was cut short (register_policy_version).
    tags = decision_tags(decision)
    for key, value in tags.items():
        client.set_model_version_tag(name, str(decision.challenger_version), key, value)
    if decision.promote:
        _move_champion(client, name, decision)
    logger.info(
        "%s v%s: %s (%s)", name, decision.challenger_version, tags[TAG_DECISION], decision.reason
    )
    return decision


def _finish_promotion(config: RegistryConfig, decision: PromotionDecision) -> None:
    """Move the champion alias as `decision` (recorded on its version) said, if a run cut short
    between the record and the move left the champion where the decision found it."""
    if not decision.promote:
        return
    client = mlflow_client(config)
    name = config.registered_model
    champion = _version_by_alias(client, name, CHAMPION)
    now = None if champion is None else str(champion.version)
    if now == decision.champion_version:
        _move_champion(client, name, decision)


def register_policy_version(
    config: RegistryConfig,
    adapter: str | Path,
    *,
    base_model: str,
    policy_version: str,
    iteration: int,
    score: float,
    run_id: str | None = None,
) -> PromotionDecision:
    """Register the adapter as a model version (challenger), then gate it into champion: what a
    training flow does at its end.

    Idempotent per (MLflow run, policy version), see register_adapter: a repeat returns the
    decision recorded on the version the first time, completing what the first call did not
    (the promotion, or the alias move), and never decides twice.
    """
    registered = register_adapter(
        config,
        adapter,
        base_model=base_model,
        policy_version=policy_version,
        iteration=iteration,
        score=score,
        run_id=run_id,
    )
    recorded = recorded_decision(str(registered.version), registered.tags)
    if recorded is None:
        return promote(config, registered.version)
    _finish_promotion(config, recorded)
    logger.info(
        "%s v%s: registered for %s before; %s",
        config.registered_model,
        registered.version,
        policy_version,
        recorded.reason,
    )
    return recorded


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
    ref = str(ref)
    if ref.isdigit():
        try:
            model_version = client.get_model_version(name, ref)
        except MlflowException as e:
            if e.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise
            return None
    else:
        model_version = _version_by_alias(client, name, ref)
        if model_version is None:
            return None
    target = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix="lightning-champion-"))
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{name}/{model_version.version}/artifacts/{ADAPTER_ARTIFACT}",
        dst_path=str(target),
    )
    return RegisteredAdapter(str(model_version.version), Path(local), _score(model_version))
