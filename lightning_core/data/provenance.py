"""Which policy produced the tokens a run trains on: the run's record, the check of each rollout
against it, and the comparison behind the probe after each publish (docs/provenance.md).

A LoRA sync that silently stopped (the server kept the old weights under the new name) or a
server restarted with another tokenizer or chat template still produces plausible spans. Each
call's span names the adapter bytes and the template that answered (security/provenance.py);
the run compares them with its own record (`ProvenanceRecord`): rollouts that disagree are
refused, and counted.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, Field, FiniteFloat

from lightning_core.semconv import ADAPTER_HASH_METADATA
from lightning_core.types import PolicyVersion, Transition

# Why a transition was refused: the values of the analytics column `provenance_refused`.
UNKNOWN_VERSION = "unknown_version"
ADAPTER_MISMATCH = "adapter_mismatch"
TEMPLATE_MISMATCH = "template_mismatch"
# A call without the version, adapter hash or template fingerprint the record expects of it:
# the gateway writes all three on every call it answers, so a span without them was not
# written by this run's gateway (or by one from before they were recorded).
MISSING_PROVENANCE = "missing_provenance"


class ProvenanceConfig(BaseModel):
    """How a run checks which policy produced the tokens it trains on."""

    check_transitions: bool = Field(
        True,
        description="Refuse rollouts whose calls' policy version, adapter hash or template "
        "fingerprint disagree with the run's record, or lack one it expects (counted as "
        "rollout/provenance_refused).",
    )
    probe: bool = Field(
        True,
        description="After each publish that changed the adapter, ask the server for the probe "
        "prompt's greedy logprobs under the new and the previous version, and stop the run "
        "(PolicyNotServed) if they are the same: the server did not load the new weights.",
    )
    probe_prompt: str = Field(
        "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:",
        min_length=1,
        max_length=4000,
        description="The fixed text the probe completes.",
    )
    probe_tokens: int = Field(8, ge=1, le=64, description="Greedy tokens the probe scores.")
    probe_tolerance: float = Field(
        1e-6,
        ge=0,
        description="Largest logprob difference still counted as 'the same': float32 on one "
        "machine repeats itself exactly; raise it for a server whose batches add noise (bf16).",
    )


class ProbeAnswer(BaseModel):
    """The probe's greedy completion under one policy version."""

    tokens: list[str]
    logprobs: list[FiniteFloat]


def probe_difference(new: ProbeAnswer, old: ProbeAnswer) -> float:
    """How far apart two versions answered the probe: infinite when their greedy tokens
    differ, else the largest difference of a token's logprob."""
    if new.tokens != old.tokens or len(new.logprobs) != len(old.logprobs):
        return float("inf")
    return max((abs(a - b) for a, b in zip(new.logprobs, old.logprobs, strict=True)), default=0.0)


class ProvenanceRecord(BaseModel):
    """What a run served: its base model, the policy versions it published (or started from)
    with the adapter hash each declared, and the fingerprint of its tokenizer and template."""

    base_model: str = Field(description="The base model's served name (a version with no adapter).")
    versions: dict[str, str | None] = Field(
        default_factory=dict,
        description="Policy version name -> the content hash its publisher declared for its "
        "adapter; None: none declared (no adapter, or a publisher that does not declare).",
    )
    template_fingerprint: str | None = Field(
        None, description="The run's template fingerprint; None: not checked."
    )

    @classmethod
    def of(
        cls,
        base_model: str,
        versions: Iterable[PolicyVersion],
        template_fingerprint: str | None = None,
    ) -> ProvenanceRecord:
        """The record of a store's policy versions, as their publishers declared them."""
        declared = {v.name: v.metadata.get(ADAPTER_HASH_METADATA) for v in versions}
        return cls(
            base_model=base_model,
            versions={name: str(h) if h is not None else None for name, h in declared.items()},
            template_fingerprint=template_fingerprint,
        )

    def disagreement(self, t: Transition) -> str | None:
        """Why `t` does not match this record (one of the reason constants), or None. A value
        the record expects and the call lacks refuses it too (MISSING_PROVENANCE): the policy
        version always; the adapter hash where the version declared one; the template
        fingerprint where the record has one."""
        version = t.policy_version
        if version is None:
            return MISSING_PROVENANCE
        if version != self.base_model:
            if version not in self.versions:
                return UNKNOWN_VERSION
            expected = self.versions[version]
            if expected is not None and t.adapter_hash is None:
                return MISSING_PROVENANCE
            if expected is not None and t.adapter_hash != expected:
                return ADAPTER_MISMATCH
        if self.template_fingerprint is not None:
            if t.template_fingerprint is None:
                return MISSING_PROVENANCE
            if t.template_fingerprint != self.template_fingerprint:
                return TEMPLATE_MISMATCH
        return None


def episode_disagreement(transitions: Iterable[Transition], record: ProvenanceRecord) -> str | None:
    """The first reason any of an episode's transitions disagrees with `record`, or None. An
    episode is kept or refused whole: calls of another policy in it would give the others
    advantages from a return the recorded policies did not earn alone."""
    return next(filter(None, map(record.disagreement, transitions)), None)
