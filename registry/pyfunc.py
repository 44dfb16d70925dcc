"""The trained policy as an MLflow pyfunc model: the class that answers prompts with the base
model and the LoRA adapter, and logging an adapter folder as such a model of a run.

A policy with one adapter per agent (TrainConfig.policy_per_agent) is one logged model all the
same: its `adapter` artifact holds a sub-folder per agent.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NamedTuple

import mlflow
from mlflow.pyfunc import PythonModel, PythonModelContext

from lightning_core.errors import InvalidInput
from lightning_rl.registry.names import TAG_AGENTS, TAG_BASE_MODEL

# The logged model's artifact key, and the folder under `artifacts/` the adapter lands in.
ADAPTER_ARTIFACT = "adapter"
# The logged model's load-time option naming the agent whose adapter answers (per-agent only).
AGENT_OPTION = "agent"
# The logged model's runtime needs, pinned to what is installed. Listed so that MLflow does not
# infer them, which loads the model in a subprocess to watch its imports: slow, and it would
# load the base model, which may have to come over the network.
_REQUIREMENTS = ("mlflow", "torch", "transformers", "peft")
# Reply length of the logged pyfunc unless loaded with model_config={"max_new_tokens": n}.
_MAX_NEW_TOKENS = 256


class AdapterModel(PythonModel):
    """The policy as an MLflow pyfunc: base model + LoRA adapter, answering chat prompts greedily.

    Each input string is one user message; the output is the assistant's reply. The pickle
    refers to this class by module and name, so loading needs lightning-rl installed (and a
    model logged before this class moved here needs its old module path importable). Load-time
    options come from `model_config` (`mlflow.pyfunc.load_model(uri, model_config={...})`); for
    a policy with one adapter per agent, `agent` picks whose adapter answers (the first agent's
    unless set).
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


class LoggedAdapter(NamedTuple):
    """An adapter logged as a pyfunc model: where it is, and the tags it was logged with."""

    model_uri: str
    tags: dict[str, str]


def log_adapter_model(
    adapter: str | Path,
    *,
    base_model: str,
    tags: Mapping[str, str],
    step: int,
    run_id: str | None = None,
) -> LoggedAdapter:
    """Log the adapter folder (one adapter, or one per agent) as a pyfunc model of the run.

    `run_id` None is this thread's active run (or none). `tags` go on the logged model, as
    its tags and metadata, with TAG_AGENTS added for a folder of one adapter per agent; the
    returned tags are those, for the registered version to carry too.
    """
    tags = dict(tags)
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
                step=step,
            )
        finally:
            pyfunc_logger.removeFilter(pickle_warning)
    return LoggedAdapter(info.model_uri, tags)
