"""MLflow tracking of training runs and the model registry of trained adapters.

One MLflow run per flow run holds the flow's params and its metrics against `step=iteration`.
Each trained LoRA adapter is logged as an MLflow pyfunc model and registered as a new version of
one registered model, which the alias `challenger` then points at. The alias `champion` (what
evaluation and serving pick up) moves to a new version only when its held-out score beats the
champion's by a margin: a gate, so that noise in a small benchmark cannot swap the served model
back and forth. Every decision is written on the version's tags, so the registry alone tells why
each version was or was not promoted.

A policy with one adapter per agent (TrainConfig.policy_per_agent) is one model version all the
same: its `adapter` artifact holds a sub-folder per agent, and the version is scored, promoted
or refused as a whole, as it was evaluated.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NamedTuple

import mlflow
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_DOES_NOT_EXIST,
    ErrorCode,
)
from mlflow.pyfunc import PythonModel, PythonModelContext
from pydantic import BaseModel, ConfigDict, Field

from lightning_core.errors import InvalidInput

logger = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
PROMOTED_EVENT = "lightning.model.promoted"
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# The logged model's artifact key, and the folder under `artifacts/` the adapter lands in.
ADAPTER_ARTIFACT = "adapter"

# Version tags: one name per fact, shared by the writer (here) and the UI's readers.
TAG_POLICY_VERSION = "policy_version"
TAG_ITERATION = "iteration"
TAG_BASE_MODEL = "base_model"
TAG_SCORE = "eval.score"
TAG_DECISION = "promotion.decision"
TAG_REASON = "promotion.reason"
TAG_CHAMPION_SCORE = "promotion.champion_score"
TAG_CHAMPION_VERSION = "promotion.champion_version"
# Comma-separated agent names of a version with one adapter per agent; absent for a shared one.
TAG_AGENTS = "agents"
# The logged model's load-time option naming the agent whose adapter answers (per-agent only).
AGENT_OPTION = "agent"

# MLflow refuses longer param values; a param is for reading in the UI, not for a whole config.
_MAX_PARAM_CHARS = 6000
# Scores are fractions in floating point (0.72 - 0.70 is 0.0199999...): without slack a gain of
# exactly the margin would be refused.
_SCORE_EPSILON = 1e-9
# The logged model's runtime needs, pinned to what is installed. Listed so that MLflow does not
# infer them, which loads the model in a subprocess to watch its imports: slow, and it would
# load the base model, which may have to come over the network.
_REQUIREMENTS = ("mlflow", "torch", "transformers", "peft")
# Reply length of the logged pyfunc unless loaded with model_config={"max_new_tokens": n}.
_MAX_NEW_TOKENS = 256


class RegistryConfig(BaseModel):
    """Where runs and models are tracked, and the gate a new version must pass to be champion."""

    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking (and registry) URI: sqlite:///path.db, http://host:5000, ...; "
        f"None: $MLFLOW_TRACKING_URI, else {DEFAULT_TRACKING_URI} in the working directory.",
    )
    artifact_location: str | None = Field(
        None,
        description="Where a new experiment stores artifacts (folder or URI); None: an "
        "`mlartifacts` folder beside a SQLite database, or the tracking server's default. "
        "An existing experiment keeps its own.",
    )
    experiment: str = Field("lightning-rl", description="MLflow experiment of the runs.")
    registered_model: str = Field(
        "lightning-policy", description="Registered model whose versions are the trained adapters."
    )
    promotion_margin: float = Field(
        0.02,
        ge=0,
        description="Held-out score a version must gain over the champion to replace it; above "
        "the benchmark's noise, so that equal policies do not swap places.",
    )
    promotion_threshold: float = Field(
        0.0,
        description="Score the first version needs to become champion when there is none; set "
        "it to the base model's score so that only an adapter that helps gets served.",
    )


# --- tracking ---------------------------------------------------------------------------------


def _tracking_uri(config: RegistryConfig) -> str:
    uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    # A relative SQLite path would follow the working directory; pin it where it was first meant.
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    return uri


def _client(config: RegistryConfig) -> MlflowClient:
    """A client on the configured URI, which also becomes the process's for fluent calls."""
    uri = _tracking_uri(config)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(uri, registry_uri=uri)


def _artifact_location(config: RegistryConfig, uri: str) -> str | None:
    location = config.artifact_location
    if location is None and uri.startswith("sqlite:///"):
        location = str(Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts")
    if location is None or "://" in location:
        return location
    return Path(location).resolve().as_uri()


def _experiment_id(client: MlflowClient, config: RegistryConfig) -> str:
    experiment = client.get_experiment_by_name(config.experiment)
    if experiment is not None:
        return experiment.experiment_id
    location = _artifact_location(config, client.tracking_uri)
    try:
        return client.create_experiment(config.experiment, artifact_location=location)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
        # Another run created it between the lookup and the create.
        return client.get_experiment_by_name(config.experiment).experiment_id


def _prefect_tags() -> dict[str, str]:
    """Links the MLflow run to the Prefect flow run it belongs to, when there is one."""
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return {}
    return {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": str(flow_run.name)}


@contextlib.contextmanager
def tracking(
    config: RegistryConfig, run_name: str | None = None, tags: Mapping[str, Any] | None = None
) -> Iterator[mlflow.ActiveRun]:
    """The MLflow run of one flow run: active inside the block, FAILED if the block raises."""
    client = _client(config)
    experiment_id = _experiment_id(client, config)
    run_tags = {**_prefect_tags(), **{k: str(v) for k, v in (tags or {}).items()}}
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=run_tags) as run:
        yield run


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:_MAX_PARAM_CHARS]
    return flat


def log_params(params: Mapping[str, Any], run_id: str | None = None) -> dict[str, str]:
    """Log params, nested dicts and pydantic models flattened to dotted keys (`trainer.lora.rank`).

    `run_id` None is this thread's active run; pass the run's id from tasks run in other threads.
    Returns what was logged.
    """
    flat = _flatten(params)
    mlflow.log_params(flat, run_id=run_id)
    return flat


def log_metrics(metrics: Mapping[str, float | None], step: int, run_id: str | None = None) -> None:
    """Log namespaced metrics (`train/loss`, `eval/score`) at `step`, the iteration; skip None."""
    values = {key: float(value) for key, value in metrics.items() if value is not None}
    if values:
        mlflow.log_metrics(values, step=step, run_id=run_id)


def log_artifact(path: str | Path, run_id: str, folder: str | None = None) -> None:
    """Attach a file (a reward curve, a report) to the run."""
    MlflowClient().log_artifact(run_id, str(path), artifact_path=folder)


# --- the logged model -------------------------------------------------------------------------


class AdapterModel(PythonModel):
    """The policy as an MLflow pyfunc: base model + LoRA adapter, answering chat prompts greedily.

    Each input string is one user message; the output is the assistant's reply. The pickle
    refers to this class by name, so loading needs lightning-rl installed. Load-time options
    come from `model_config` (`mlflow.pyfunc.load_model(uri, model_config={...})`); for a policy
    with one adapter per agent, `agent` picks whose adapter answers (the first agent's unless set).
    """

    def load_context(self, context: PythonModelContext) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lightning_core.algo.trainer import agent_adapter_dirs
        from lightning_core.models import resolve_model

        base = resolve_model(context.model_config[TAG_BASE_MODEL])
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base)
        adapter = Path(context.artifacts[ADAPTER_ARTIFACT])
        agents = agent_adapter_dirs(adapter)
        if agents:
            agent = context.model_config.get(AGENT_OPTION) or next(iter(agents))
            if agent not in agents:
                raise InvalidInput(
                    f"this policy has adapters for agents {', '.join(agents)}; not {agent!r}"
                )
            adapter = agents[agent]
        self.model = PeftModel.from_pretrained(model, str(adapter)).eval()
        self.max_new_tokens = int(context.model_config.get("max_new_tokens", _MAX_NEW_TOKENS))

    def predict(
        self,
        context: PythonModelContext,
        model_input: list[str],
        params: dict[str, Any] | None = None,
    ) -> list[str]:
        import torch

        from lightning_core.gateway.chat import encode, render_chat

        replies = []
        for prompt in model_input:
            text = render_chat(self.tokenizer, [{"role": "user", "content": prompt}])
            ids = torch.tensor([encode(self.tokenizer, text)], device=self.model.device)
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
            replies.append(self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        return replies


def _requirements() -> list[str]:
    pins = []
    for dist in _REQUIREMENTS:
        with contextlib.suppress(PackageNotFoundError):
            # A local build label (torch's +cpu, +cu128) names no package an index serves.
            pins.append(f"{dist}=={version(dist).split('+')[0]}")
    return pins


def _staged_adapter(adapter: Path, scratch: Path) -> tuple[Path, list[str]]:
    """A copy of the adapter folder without the trainer's optimizer state, named `adapter`, and
    the agents it has an adapter each for (none: one adapter, shared).

    The optimizer state is for resuming training, not for serving, and is twice the adapter's
    size; the fixed folder name fixes where the adapter lies inside the logged model. A policy
    with one adapter per agent keeps its layout: a sub-folder per agent.
    """
    from lightning_core.algo.trainer import ADAPTER_CONFIG, STATE_FILE, agent_adapter_dirs

    agents = agent_adapter_dirs(adapter)
    if not agents and not (adapter / ADAPTER_CONFIG).is_file():
        raise InvalidInput(
            f"{adapter} is not a PEFT adapter folder (no {ADAPTER_CONFIG}), nor a folder of "
            "one per agent; pass the folder that LoRATrainer.save (or save_pretrained) wrote"
        )
    staged = scratch / ADAPTER_ARTIFACT
    ignore = shutil.ignore_patterns(STATE_FILE)
    if not agents:
        shutil.copytree(adapter, staged, ignore=ignore)
    for agent, path in agents.items():
        shutil.copytree(path, staged / agent, ignore=ignore)
    return staged, list(agents)


class _DropPickleWarning(logging.Filter):
    # MLflow warns that any pickled python_model may run code when unpickled; this one pickles
    # only a reference to AdapterModel, and the warning would repeat on every iteration.
    def filter(self, record: logging.LogRecord) -> bool:
        return "`python_model` causes it to be serialized" not in record.getMessage()


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
    """
    if not math.isfinite(score):
        raise InvalidInput(f"the adapter's score is {score}; evaluation must give a number")
    client = _client(config)
    # The logged model joins the active experiment, not its run's: without this, a call from a
    # thread without the active run (or without any run) would file it under Default.
    mlflow.set_experiment(experiment_id=_experiment_id(client, config))
    tags = {
        TAG_POLICY_VERSION: policy_version,
        TAG_ITERATION: str(iteration),
        TAG_BASE_MODEL: base_model,
        TAG_SCORE: repr(float(score)),
    }
    model_config: dict[str, Any] = {TAG_BASE_MODEL: base_model, "max_new_tokens": _MAX_NEW_TOKENS}
    pickle_warning = _DropPickleWarning()
    pyfunc_logger = logging.getLogger("mlflow.pyfunc")
    with tempfile.TemporaryDirectory(prefix="lightning-adapter-") as scratch:
        staged, agents = _staged_adapter(Path(adapter), Path(scratch))
        if agents:
            tags[TAG_AGENTS] = ",".join(agents)
            model_config[AGENT_OPTION] = agents[0]
        pyfunc_logger.addFilter(pickle_warning)
        try:
            # Model.log rather than pyfunc.log_model: it takes the run explicitly, so a task in
            # another thread logs into the flow's run without resuming (and ending) it.
            info = mlflow.models.Model.log(
                artifact_path=None,  # deprecated for `name`, yet still a required argument
                name="policy",
                flavor=mlflow.pyfunc,
                run_id=run_id,
                python_model=AdapterModel(),
                artifacts={ADAPTER_ARTIFACT: str(staged)},
                pip_requirements=_requirements(),
                # Only keys present here can be overridden at load time.
                model_config=model_config,
                metadata=tags,
                tags=tags,
                step=iteration,
            )
        finally:
            pyfunc_logger.removeFilter(pickle_warning)
    registered = mlflow.register_model(info.model_uri, config.registered_model, tags=tags)
    client.set_registered_model_alias(config.registered_model, CHALLENGER, str(registered.version))
    return registered


# --- promotion --------------------------------------------------------------------------------


class PromotionDecision(BaseModel):
    """Whether a version becomes champion, and why."""

    model_config = ConfigDict(frozen=True)

    promote: bool = Field(description="True: the challenger becomes champion.")
    reason: str = Field(description="Why, in words, with both scores.")
    challenger_score: float = Field(description="Held-out score of the new version.")
    champion_score: float | None = Field(
        description="Held-out score of the champion at decision time; None when there was none."
    )
    challenger_version: str | None = Field(None, description="Registry version decided on.")
    champion_version: str | None = Field(
        None, description="Champion's version before the decision; None when there was none."
    )


def decide_promotion(
    challenger_score: float, champion_score: float | None, margin: float, threshold: float
) -> PromotionDecision:
    """The gate: beat the champion by `margin`, or, with no champion, reach `threshold`."""
    for name, score in (("challenger", challenger_score), ("champion", champion_score)):
        if score is not None and not math.isfinite(score):
            raise InvalidInput(f"the {name}'s score is {score}; evaluation must give a number")
    if champion_score is None:
        promote = challenger_score >= threshold - _SCORE_EPSILON
        relation = "reaches" if promote else "is below"
        reason = f"no champion yet; score {challenger_score:.4g} {relation} threshold {threshold:g}"
    else:
        gain = challenger_score - champion_score
        promote = gain >= margin - _SCORE_EPSILON
        relation = "at least" if promote else "less than"
        reason = (
            f"score {challenger_score:.4g} vs champion {champion_score:.4g}: gain {gain:+.4g} is "
            f"{relation} the margin {margin:g}"
        )
    return PromotionDecision(
        promote=promote,
        reason=reason,
        challenger_score=challenger_score,
        champion_score=champion_score,
    )


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


def _should_emit_events() -> bool:
    # Outside a run and without a server, Prefect would start a local ephemeral server (seconds)
    # to store an event no automation is listening to.
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.settings import PREFECT_API_URL

    return bool(FlowRunContext.get() or TaskRunContext.get() or PREFECT_API_URL.value())


def _emit_promoted(name: str, decision: PromotionDecision) -> None:
    """Tell Prefect (automations, deployments triggered on it) that the champion changed.

    Best effort: the alias has already moved, and a lost event must not undo that.
    """
    try:
        if not _should_emit_events():
            return
        from prefect.events import emit_event

        emit_event(
            event=PROMOTED_EVENT,
            resource={
                "prefect.resource.id": f"mlflow.model.{name}.{decision.challenger_version}",
                "prefect.resource.name": f"{name} v{decision.challenger_version}",
                "mlflow.registered_model": name,
                "mlflow.model_version": str(decision.challenger_version),
            },
            payload=decision.model_dump(mode="json"),
        )
    except Exception:
        logger.warning("could not emit %s for %s", PROMOTED_EVENT, name, exc_info=True)


def promote(config: RegistryConfig, model_version: str | int) -> PromotionDecision:
    """Gate `model_version` (scored by its `eval.score` tag) against the current champion.

    On promotion the alias `champion` moves to it and a `lightning.model.promoted` event is
    emitted; either way the decision, reason and both scores are tagged on the version.
    """
    client = _client(config)
    name = config.registered_model
    candidate = client.get_model_version(name, str(model_version))
    score = _score(candidate)
    if score is None:
        raise InvalidInput(
            f"{name} v{candidate.version} has no numeric {TAG_SCORE} tag; register it with "
            "register_adapter (which records the score) or set the tag"
        )
    champion = _version_by_alias(client, name, CHAMPION)
    champion_score = None if champion is None else _score(champion)
    if champion is not None and str(champion.version) == str(candidate.version):
        decision = PromotionDecision(
            promote=False,
            reason="already the champion",
            challenger_score=score,
            champion_score=champion_score,
        )
    elif champion is not None and champion_score is None:
        # A champion set by hand without a score cannot be compared; replacing it blindly
        # could serve a worse model.
        decision = PromotionDecision(
            promote=False,
            reason=f"champion v{champion.version} has no numeric {TAG_SCORE} tag to compare "
            "with; tag it, or move the alias by hand",
            challenger_score=score,
            champion_score=None,
        )
    else:
        decision = decide_promotion(
            score, champion_score, config.promotion_margin, config.promotion_threshold
        )
    # ModelVersion.version is an int from the SQLite store though typed str: normalise.
    version = str(candidate.version)
    champion_version = None if champion is None else str(champion.version)
    decision = decision.model_copy(
        update={"challenger_version": version, "champion_version": champion_version}
    )
    tags = {
        TAG_DECISION: "promoted" if decision.promote else "rejected",
        TAG_REASON: decision.reason,
        TAG_CHAMPION_SCORE: "none" if champion_score is None else repr(champion_score),
        TAG_CHAMPION_VERSION: champion_version or "none",
    }
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    if decision.promote:
        client.set_registered_model_alias(name, CHAMPION, version)
        _emit_promoted(name, decision)
    logger.info("%s v%s: %s (%s)", name, version, tags[TAG_DECISION], decision.reason)
    return decision


def publish_adapter(
    config: RegistryConfig,
    adapter: str | Path,
    *,
    base_model: str,
    policy_version: str,
    iteration: int,
    score: float,
    run_id: str | None = None,
) -> PromotionDecision:
    """register_adapter, then promote the new version: what a training flow does at its end."""
    registered = register_adapter(
        config,
        adapter,
        base_model=base_model,
        policy_version=policy_version,
        iteration=iteration,
        score=score,
        run_id=run_id,
    )
    return promote(config, registered.version)


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
    client = _client(config)
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
