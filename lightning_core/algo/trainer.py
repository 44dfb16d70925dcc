"""The LoRA trainer: one policy-gradient update of a PEFT adapter per batch of transitions.

Each transition is trained as its own single-turn sample (prompt ids -> response ids) with the
advantage credit assignment gave it. Calls of one agent whose prompts extend each other share
one forward pass (prefix.py), each still its own sample: its own advantage, behaviour logprobs
and weight. The batch is cut into micro-batches of rows that fit a token budget; each call's
loss is weighted by its share of the whole batch (`sequence_weights`, by the configured
aggregation), so that the accumulated gradient equals one over the whole batch; then the
gradient is clipped and AdamW steps. Each saved version holds the adapter (PEFT format) and the
optimizer state, so that training resumes exactly where it stopped.

Offline data (production episodes, sampled by an earlier policy) trains either by the same
policy-gradient step, whose ratio to the recorded logprobs corrects for the policy having moved,
or, when it moved too far for that (`behaviour_gap` measures how far), by the likelihood
objective on the good episodes only (see offline.py).

A policy with one adapter per agent of a multi-agent system is one trainer per agent, each saved
into a sub-folder named after its agent (`<policy>/<agent>/`); `agent_adapter_dirs` reads that
layout back, for publishing and registering the agents' adapters together.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.constrained import GrammarReplay, MaskedSpan, renormalise
from lightning_core.algo.frozen import FrozenActivations, replay_point
from lightning_core.algo.losses import (
    entropy_from_logits,
    k3,
    likelihood_loss,
    policy_loss,
    sequence_weights,
)
from lightning_core.algo.prefix import (
    length_key,
    merge_rows,
    pack_by_length,
    prefix_breaks,
    row_length,
)
from lightning_core.algo.shared_prefix import (
    forward_shared,
    forward_tokens,
    order_key,
    pack,
    shared_length,
)
from lightning_core.errors import InvalidInput
from lightning_core.models import resolve_model
from lightning_core.security.adapter_folder import AdapterRules, adapter_config
from lightning_core.types import Transition

STATE_FILE = "trainer_state.pt"
# The finish reason of a call cut at its token limit (overlong filtering).
TRUNCATED = "length"
# The file that marks a folder as one PEFT adapter.
ADAPTER_CONFIG = "adapter_config.json"
# policy_gradient: PPO-clip on advantages; likelihood: maximise the responses' log-likelihood.
Objective = Literal["policy_gradient", "likelihood"]
# Log-ratios beyond this are clamped in behaviour_gap: the gap stays finite (e^20 already says
# "far off") on a token the recorded policy found near impossible.
MAX_LOG_RATIO = 20.0
# The sums behaviour_gap's metrics are made of.
GAP_SUMS = ("gap_kl", "gap_outside", "gap_tokens")


def agent_adapter_dirs(folder: str | Path) -> dict[str, Path]:
    """The adapters of a policy saved one per agent (`<folder>/<agent>/`), by agent name; empty
    when `folder` is itself one adapter, which every agent shares."""
    folder = Path(folder)
    if (folder / ADAPTER_CONFIG).is_file() or not folder.is_dir():
        return {}
    return {sub.name: sub for sub in sorted(folder.iterdir()) if (sub / ADAPTER_CONFIG).is_file()}


def _load_state(path: Path, device: torch.device) -> dict[str, Any]:
    """The optimizer state, version and RNG state `save` wrote: tensors, numbers and
    containers, loaded without unpickling anything else (the file may come from the
    registry, where a pickle would run its writer's code here)."""
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:
        raise InvalidInput(
            f"{path} is not a trainer state this trainer wrote: it holds more than tensors, "
            f"numbers and containers, and is not loaded ({str(exc).splitlines()[0][:300]}); "
            f"delete it to start the optimizer afresh from the adapter"
        ) from exc
    if not isinstance(saved, dict) or not {"optimizer", "version", "rng"} <= saved.keys():
        raise InvalidInput(f"{path} lacks the optimizer, version and rng a trainer state holds")
    return saved


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    # transformers 5 deprecates the gradient checkpointing names that PEFT (and we, for older
    # versions' sake) still call, with a FutureWarning on every run: noise for a user, who can
    # do nothing about it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated")
        yield


class LoRATrainer:
    """Trains a LoRA adapter on top of a frozen base model."""

    def __init__(self, config: TrainerConfig | None = None, adapter: str | Path | None = None):
        from peft import LoraConfig, PeftModel, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        self.config = config = config or TrainerConfig()
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype_name = config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = getattr(torch, dtype_name)
        torch.manual_seed(config.seed)
        # A local folder loads in about a second: its progress bar in the run's terminal read
        # as a stage of its own, or as a failure when it tore the live view.
        hf_logging.disable_progress_bar()
        base = AutoModelForCausalLM.from_pretrained(resolve_model(config.model), dtype=self.dtype)
        base.to(self.device)
        if config.gradient_checkpointing:
            with _quietly():
                base.gradient_checkpointing_enable()
            base.enable_input_require_grads()
        if adapter is not None:
            # The folder may come from the registry (warm_start=champion): whoever registered
            # it chose its files, so they are checked before PEFT reads them.
            adapter_config(Path(adapter), self._adapter_limits())
            with _quietly():
                self.model = PeftModel.from_pretrained(base, str(adapter), is_trainable=True)
        else:
            layers = base.config.num_hidden_layers
            top = config.lora.top_layers
            lora = LoraConfig(
                r=config.lora.rank,
                lora_alpha=config.lora.alpha,
                lora_dropout=config.lora.dropout,
                target_modules=config.lora.target_modules,
                layers_to_transform=list(range(layers - top, layers)) if top else None,
            )
            with _quietly():
                self.model = get_peft_model(base, lora)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.learning_rate, weight_decay=config.weight_decay
        )
        self.version = 0
        state = Path(adapter) / STATE_FILE if adapter is not None else None
        if state is not None and state.is_file():
            saved = _load_state(state, self.device)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.version = saved["version"]
            torch.set_rng_state(saved["rng"])
        self.pad_id = 0
        # Set by whoever trains the same rows again (offline epochs): the frozen layers' output
        # is replayed from it (frozen.py); None runs every forward pass whole.
        self.frozen: FrozenActivations | None = None
        # Forward passes that replayed cached frozen activations, and that computed them.
        self.replayed = self.computed = 0
        self._replay = replay_point(
            self.model, resolve_model(config.model), self.dtype, config.gradient_checkpointing
        )
        # Constrained calls are renormalised over what their grammar allowed (constrained.py).
        self._grammar = GrammarReplay(config.model, base.get_input_embeddings().num_embeddings)

    def _adapter_limits(self) -> AdapterRules:
        # An adapter this config trains is never refused for its own rank or modules.
        lora, defaults = self.config.lora, AdapterRules()
        return AdapterRules(
            max_adapter_rank=max(defaults.max_adapter_rank, lora.rank),
            max_adapter_target_modules=max(
                defaults.max_adapter_target_modules, len(lora.target_modules)
            ),
        )

    # ------------------------------------------------------------------ batching

    def _rows(self, transitions: Sequence[Transition], merge: bool) -> list[list[Transition]]:
        """The transitions as rows of one forward pass each, shortest first (similar lengths
        together: less padding), ties by content, never by rollout id: chains of
        calls that extend each other when `merge`, else one call per row. A row longer than
        micro_batch_tokens gets a micro-batch of its own (_micro_batches)."""
        rows = merge_rows(transitions) if merge else [[t] for t in transitions]
        if self._sharing():
            # Rows of one prompt together, so that a micro-batch computes it once.
            return sorted(rows, key=order_key)
        return sorted(rows, key=length_key)

    def _sharing(self) -> bool:
        """Whether micro-batches compute their rows' shared prefix once (shared_prefix.py):
        not where the cache of keys and values is unavailable (gradient checkpointing) or the
        frozen layers' output is replayed by whole rows (frozen.py)."""
        c = self.config
        return c.prefix_share and not c.gradient_checkpointing and self.frozen is None

    def _micro_batches(self, rows: list[list[Transition]]) -> list[list[list[Transition]]]:
        """Consecutive groups of rows whose padded size (rows x longest row, the shared prefix
        counted once when shared) fits the token budget; a row longer than the budget alone
        (its memory is its own length's)."""
        pack_rows = pack if self._sharing() else pack_by_length
        return pack_rows(rows, self.config.micro_batch_tokens)

    def _tensors(
        self, rows: list[list[Transition]], weights: dict[int, float] | None = None
    ) -> tuple[dict[str, torch.Tensor], list[MaskedSpan], list[tuple[int, int, int]]]:
        """Right-padded inputs, and per target position: mask, old logprobs, advantage,
        temperature, the call it belongs to (`segments`) and its loss weight; the positions of
        constrained calls with the tokens their grammar allowed; and each call's (row, start,
        end) target positions, in the order of the rows."""
        length = max(row_length(row) for row in rows)
        n = len(rows)
        ids = torch.full((n, length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, length), dtype=torch.long)
        # Target position j predicts token j + 1. Only positions from the shortest prompt's last
        # token on predict a response token: the per-target tensors start there, and so do the
        # logits, since the LM head over a 49k vocabulary is a large share of a small model's
        # compute and prompts are most of each row.
        first = min(len(row[0].prompt_token_ids) for row in rows) - 1
        width = length - 1 - first
        mask = torch.zeros((n, width), dtype=self.dtype)
        old = torch.zeros((n, width), dtype=torch.float32)
        advantage = torch.zeros((n, width), dtype=torch.float32)
        # Greedy calls report logprobs at T = 1 (backends/base.py), so they train at 1 too.
        temperature = torch.ones((n, width), dtype=torch.float32)
        segments = torch.full((n, width), -1, dtype=torch.long)
        weight = torch.zeros((n, width), dtype=torch.float32)
        masked: list[MaskedSpan] = []
        positions: list[tuple[int, int, int]] = []
        for i, row in enumerate(rows):
            seq = row[-1].prompt_token_ids + row[-1].response_token_ids
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
            for t in row:
                start = len(t.prompt_token_ids) - 1 - first
                end = start + len(t.response_token_ids)
                mask[i, start:end] = 1
                # Always there for the policy gradient (_check); the likelihood does not need
                # them.
                if len(t.response_logprobs) == len(t.response_token_ids):
                    old[i, start:end] = torch.tensor(t.response_logprobs, dtype=torch.float32)
                advantage[i, start:end] = float(t.advantage or 0.0)
                temperature[i, start:end] = t.temperature or 1.0
                segments[i, start:end] = len(positions)
                if weights is not None:
                    weight[i, start:end] = weights[id(t)]
                if t.output_constraint is not None:
                    allowed = self._grammar.allowed(t.output_constraint, t.response_token_ids)
                    masked.append(MaskedSpan(i, start, end, allowed))
                positions.append((i, start, end))
        tensors = {
            "ids": ids,
            "attention": attention,
            "mask": mask,
            "old": old,
            "adv": advantage,
            "temperature": temperature,
            "segments": segments,
            "weight": weight,
            # Leading tokens every row shares, computed once (0: each row whole).
            "shared": torch.tensor(shared_length(rows) if self._sharing() else 0),
        }
        return {k: v.to(self.device) for k, v in tensors.items()}, masked, positions

    def _logprobs(self, x: dict[str, torch.Tensor], masked: list[MaskedSpan]) -> tuple[Any, Any]:
        """Log-probabilities of the last `width` target tokens of each row (and their logits)
        under the distribution each call was sampled from: tempered as it was, and for
        constrained calls over their grammar's allowed tokens. On fresh rollouts they equal the
        recorded behaviour logprobs, so every importance ratio starts at 1."""
        ids, width = x["ids"], x["mask"].shape[1]
        out = self._forward(ids, x["attention"], width + 1, int(x["shared"]))
        logits = out.logits[:, :-1].float() / x["temperature"][:, :, None]
        logp = torch.log_softmax(logits, dim=-1)
        targets = ids[:, ids.shape[1] - width :]
        chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return renormalise(chosen, logits, masked), logits

    def _forward(
        self, ids: torch.Tensor, attention: torch.Tensor, keep: int, shared: int = 0
    ) -> Any:
        """The model's forward pass over a micro-batch: the first `shared` tokens once for all
        rows when they share them (shared_prefix.py); from the first adapted layer on when the
        frozen layers' output on these rows is cached (and cached when it is not)."""
        if shared:
            return forward_shared(self.model, ids, attention, keep, shared)
        if self.frozen is None or self._replay is None:
            return self.model(input_ids=ids, attention_mask=attention, logits_to_keep=keep)
        out, replayed = self._replay.forward(self.model, self.frozen, ids, attention, keep)
        self.replayed += replayed
        self.computed += not replayed
        return out

    # ------------------------------------------------------------------ the update

    def _check(
        self, transitions: Sequence[Transition], advantage: bool = True, logprobs: bool = True
    ) -> None:
        if not transitions:
            raise InvalidInput("a training step needs at least one transition")
        for t in transitions:
            if advantage and t.advantage is None:
                raise InvalidInput(
                    f"transition {t.rollout_id}#{t.step} has no advantage: assign credit first"
                )
            if not t.response_token_ids:
                raise InvalidInput(f"transition {t.rollout_id}#{t.step} has no response token")
            if logprobs and len(t.response_logprobs) != len(t.response_token_ids):
                raise InvalidInput(
                    f"transition {t.rollout_id}#{t.step} needs one behaviour logprob per response "
                    f"token ({len(t.response_logprobs)} for {len(t.response_token_ids)})"
                )

    @torch.no_grad()
    def _current(
        self, rows: list[list[Transition]]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[tuple[int, int, int]]]:
        """A micro-batch's tensors and the current policy's logprobs of its response tokens, in
        eval mode (no dropout) and without gradient; and each call's positions."""
        training = self.model.training
        self.model.eval()
        try:
            x, masked, positions = self._tensors(rows)
            logp, _ = self._logprobs(x, masked)
        finally:
            self.model.train(training)
        return x, logp, positions

    def response_logprobs(self, transitions: Sequence[Transition]) -> list[list[float]]:
        """The current policy's logprob of each response token, per transition in input order
        (tempered and constrained as each call was sampled); no gradient, no update."""
        self._check(transitions, advantage=False, logprobs=False)
        found: dict[int, list[float]] = {}
        rows = self._rows(transitions, self.config.prefix_merge)
        for batch in self._micro_batches(rows):
            _, logp, positions = self._current(batch)
            calls = [t for row in batch for t in row]
            for t, (i, start, end) in zip(calls, positions, strict=True):
                found[id(t)] = logp[i, start:end].tolist()
        return [found[id(t)] for t in transitions]

    def behaviour_gap(self, transitions: Sequence[Transition]) -> dict[str, float]:
        """How far the current policy is from the one that sampled the transitions, over their
        response tokens (no gradient, no update): `offline/behaviour_kl`, the mean per-token k3
        estimate of KL(behaviour || current); `offline/outside_clip`, the fraction of tokens
        whose importance ratio lies outside [1 - clip_low, 1 + clip_high], where PPO-clip stops
        learning from them; `offline/tokens`, how many tokens that is measured on."""
        self._check(transitions, advantage=False)
        sums = dict.fromkeys(GAP_SUMS, 0.0)
        for batch in self._micro_batches(self._rows(transitions, self.config.prefix_merge)):
            x, logp, _ = self._current(batch)
            self._add_gap(sums, logp, x)
        return self.gap_metrics(sums)

    def _add_gap(self, sums: dict[str, float], logp: torch.Tensor, x: dict[str, Any]) -> None:
        c = self.config
        mask = x["mask"].float()
        log_ratio = (logp.detach() - x["old"]).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        beyond = (ratio < 1.0 - c.clip_low) | (ratio > 1.0 + c.clip_high)
        sums["gap_kl"] += float((k3(log_ratio) * mask).sum())
        sums["gap_outside"] += float((beyond.float() * mask).sum())
        sums["gap_tokens"] += float(mask.sum())

    @staticmethod
    def gap_metrics(sums: dict[str, float]) -> dict[str, float]:
        """behaviour_gap's metrics from the sums _add_gap makes."""
        return {
            "offline/behaviour_kl": sums["gap_kl"] / sums["gap_tokens"],
            "offline/outside_clip": sums["gap_outside"] / sums["gap_tokens"],
            "offline/tokens": sums["gap_tokens"],
        }

    def dropout_free(self) -> bool:
        """Whether a forward pass in train mode computes what eval mode does (no dropout
        anywhere, the LoRA path's included): then the update's own forward pass measures the
        behaviour gap (gated_step)."""
        if float(getattr(self.model.config, "attention_dropout", 0.0) or 0.0) > 0:
            return False
        return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())

    def gated_step(
        self, transitions: Sequence[Transition], accept: Callable[[dict[str, float]], bool]
    ) -> tuple[dict[str, float], dict[str, float] | None]:
        """behaviour_gap of the transitions, then a policy-gradient step on them only if
        `accept(gap)`: returns the gap and the step's metrics (None when refused: nothing
        changed). Without dropout the update's own forward pass, taken before the optimizer
        steps, is the policy the gap is measured on, so the gap comes from it and a refusal
        drops the gradients: one forward pass over the batch less than behaviour_gap then step
        (on the demo's offline batches about a third of an epoch's time). With dropout, the
        eval-mode pass first, as behaviour_gap alone."""
        if not self.dropout_free():
            gap = self.behaviour_gap(transitions)
            return gap, (self.step(transitions) if accept(gap) else None)
        self._check(transitions)
        return self._update(transitions, "policy_gradient", accept)

    def step(
        self, transitions: Sequence[Transition], objective: Objective = "policy_gradient"
    ) -> dict[str, float]:
        """One optimizer update over the whole batch; returns `train/*` metrics.

        policy_gradient: PPO-clip on each transition's advantage, importance-weighted by the
        ratio to its recorded behaviour logprobs. likelihood: the negative mean log-likelihood of
        the response tokens (advantages and behaviour logprobs are not used), for reward-filtered
        fine-tuning, where only good responses are passed. Both aggregate, micro-batch and
        penalise KL to the base model alike; likelihood reports clip_frac 0."""
        if objective not in ("policy_gradient", "likelihood"):
            raise InvalidInput(
                f"unknown objective {objective!r}; use policy_gradient or likelihood"
            )
        likelihood = objective == "likelihood"
        self._check(transitions, advantage=not likelihood, logprobs=not likelihood)
        metrics = self._update(transitions, objective)[1]
        assert metrics is not None  # nothing to refuse without `accept`
        return metrics

    def _update(
        self,
        transitions: Sequence[Transition],
        objective: Objective,
        accept: Callable[[dict[str, float]], bool] | None = None,
    ) -> tuple[dict[str, float], dict[str, float] | None]:
        """step's update on checked transitions; with `accept`, the behaviour gap is taken from
        the same forward pass and the gradients are dropped, before the optimizer steps, when
        it refuses (gated_step). Returns the gap ({} without `accept`) and step's metrics."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        weights = self.loss_weights(transitions)
        before = (self.replayed, self.computed)
        sums = self.accumulate(transitions, objective, weights, gap=accept is not None)
        replayed, computed = self.replayed - before[0], self.computed - before[1]
        gap = self.gap_metrics(sums) if accept is not None else {}
        if accept is not None and not accept(gap):
            self.optimizer.zero_grad(set_to_none=True)
            return gap, None
        grad_norm = self.apply_gradients()
        seconds = time.perf_counter() - started
        metrics = self.step_metrics(sums, grad_norm, seconds) | self.batch_metrics(transitions)
        if replayed + computed:
            # The share of forward passes that skipped the frozen layers (frozen.py).
            metrics["train/frozen_replayed_frac"] = replayed / (replayed + computed)
        return gap, metrics

    # The three parts of step, which a data-parallel update (distributed.py) runs with the
    # batch's global loss weights and all-reduces between accumulate and apply_gradients.

    def filtered(self, t: Transition) -> bool:
        """Whether overlong filtering leaves this call out of the loss."""
        return self.config.overlong_filter and t.finish_reason == TRUNCATED

    def loss_weights(self, transitions: Sequence[Transition]) -> dict[int, float]:
        """Each transition's weight (by id) in the loss over the whole batch: the configured
        aggregation's w_i (losses.sequence_weights), 0 for a call overlong filtering drops."""
        c = self.config
        lengths = [0 if self.filtered(t) else len(t.response_token_ids) for t in transitions]
        found = sequence_weights(
            lengths, [t.rollout_id for t in transitions], c.aggregation, c.loss_norm_tokens
        )
        return {id(t): w for t, w in zip(transitions, found, strict=True)}

    def batch_metrics(self, transitions: Sequence[Transition]) -> dict[str, float]:
        """Metrics of the batch as a whole: the share of calls overlong filtering dropped, and
        per agent the calls whose prompt did not extend the agent's previous call (prefix.py);
        the same on every process of a data-parallel update."""
        breaks = prefix_breaks(transitions)
        metrics = {
            "train/overlong_frac": sum(map(self.filtered, transitions)) / len(transitions),
            "train/prefix_breaks": float(sum(breaks.values())),
        }
        return metrics | {f"train/prefix_breaks/{a}": float(n) for a, n in breaks.items()}

    def accumulate(
        self,
        transitions: Sequence[Transition],
        objective: Objective,
        weights: dict[int, float],
        gap: bool = False,
    ) -> dict[str, float]:
        """Backward over the transitions in micro-batches, each call's loss weighted by its
        share of the whole batch (`weights`, from loss_weights), adding to the gradients; the
        sums the metrics are made of (with `gap`, behaviour_gap's too, from the same pass)."""
        c = self.config
        likelihood = objective == "likelihood"
        self.model.train()
        sums = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0, "tokens": 0.0}
        sums |= {"is_ratio": 0.0, "is_truncated": 0.0, "is_ratio_max": 0.0, "ratio_masked": 0.0}
        sums["all_tokens"] = float(
            sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in transitions)
        )
        rows = self._rows(transitions, c.prefix_merge)
        sums["forward_tokens"] = 0.0
        if gap:
            sums |= dict.fromkeys(GAP_SUMS, 0.0)
        for batch in self._micro_batches(rows):
            x, masked, _ = self._tensors(batch, weights)
            sums["forward_tokens"] += forward_tokens(batch, int(x["shared"]))
            logp, logits = self._logprobs(x, masked)
            if gap:
                self._add_gap(sums, logp, x)
            ref = None
            if c.kl_coef:
                with torch.no_grad(), self.model.disable_adapter():
                    ref, _ = self._logprobs(x, masked)
            if likelihood:
                out = likelihood_loss(
                    logp, x["mask"], ref_logprobs=ref, kl_coef=c.kl_coef, weights=x["weight"]
                )
            else:
                out = policy_loss(
                    logp,
                    x["old"],
                    x["adv"],
                    x["mask"],
                    clip_low=c.clip_low,
                    clip_high=c.clip_high,
                    ref_logprobs=ref,
                    kl_coef=c.kl_coef,
                    tis_cap=c.tis_cap,
                    importance_ratio=c.importance_ratio,
                    ratio_mask=c.ratio_mask,
                    weights=x["weight"],
                    segments=x["segments"],
                )
            batch_tokens = int(x["mask"].sum())
            out.loss.backward()
            sums["loss"] += float(out.loss.detach())
            sums["kl"] += out.kl * batch_tokens
            sums["clip_frac"] += out.clip_frac * batch_tokens
            sums["entropy"] += entropy_from_logits(logits, x["mask"]) * batch_tokens
            sums["tokens"] += batch_tokens
            sums["is_ratio"] += out.ratio_mean * batch_tokens
            sums["is_truncated"] += out.truncated_frac * batch_tokens
            sums["is_ratio_max"] = max(sums["is_ratio_max"], out.ratio_max)
            sums["ratio_masked"] += out.ratio_masked_frac * batch_tokens
        return sums

    def apply_gradients(self) -> float:
        """Clip the accumulated gradient and step the optimizer; the norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.version += 1
        return float(grad_norm)

    @staticmethod
    def step_metrics(sums: dict[str, float], grad_norm: float, seconds: float) -> dict[str, float]:
        """step's `train/*` metrics from accumulate's sums (over all processes' shares)."""
        tokens = sums["tokens"]
        return {
            "train/loss": sums["loss"],
            "train/kl": sums["kl"] / tokens,
            "train/clip_frac": sums["clip_frac"] / tokens,
            "train/entropy": sums["entropy"] / tokens,
            "train/grad_norm": grad_norm,
            "train/tokens_per_s": sums["all_tokens"] / seconds,
            # The importance ratio to the behaviour policy at the start of the update: about 1
            # on fresh rollouts, further from it the staler they are (and the ones tis_cap cut).
            "train/is_ratio_mean": sums["is_ratio"] / tokens,
            "train/is_ratio_max": sums["is_ratio_max"],
            "train/is_truncated_frac": sums["is_truncated"] / tokens,
            "train/ratio_masked_frac": sums["ratio_masked"] / tokens,
            # What prefix merging and sharing saved: the share of the calls' tokens no forward
            # pass computed.
            "train/forward_tokens_saved_frac": 1.0 - sums["forward_tokens"] / sums["all_tokens"],
        }

    # ------------------------------------------------------------------ versions

    def save(self, folder: str | Path) -> Path:
        """The adapter in PEFT format plus the optimizer state, to serve or to resume from."""
        folder = Path(folder)
        self.model.save_pretrained(folder)
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "version": self.version,
                "rng": torch.get_rng_state(),
            },
            folder / STATE_FILE,
        )
        return folder

    def lora_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def base_state(self) -> dict[str, torch.Tensor]:
        return {
            n: p.detach().clone() for n, p in self.model.named_parameters() if not p.requires_grad
        }
