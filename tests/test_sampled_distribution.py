"""Training sees the distribution the rollouts were sampled from (tiny model, real gateway).

Rollouts sampled at T = 0.8 record the logprobs of the tempered distribution; the trainer
tempers its own logits by each transition's temperature, so on fresh rollouts, before any
update, every response token's importance ratio is 1 and nothing is clipped.
"""

from __future__ import annotations

import httpx
import openai
import torch

from lightning_core.algo.config import TrainerConfig
from lightning_core.algo.trainer import LoRATrainer
from lightning_core.data.adapter import spans_to_transitions
from lightning_core.models import tiny_model_dir
from lightning_core.types import Span
from tests.conftest import gateway_server


def _fresh_transitions(temperature: float) -> list:
    transitions = []
    with gateway_server(model="tiny") as server, httpx.Client(base_url=server.url) as http:
        for k in range(3):
            http.post("/store/rollouts", json={"rollouts": [{"input": k}]}).raise_for_status()
            claim = http.post("/store/dequeue", json={"worker_id": "w"}).json()
            rollout_id = claim["rollout"]["rollout_id"]
            attempt_id = claim["attempt"]["attempt_id"]
            client = openai.OpenAI(
                base_url=f"{server.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1",
                api_key="unused",
                max_retries=0,
            )
            for turn in range(2):
                client.chat.completions.create(
                    model=server.model,
                    messages=[{"role": "user", "content": f"Question {k}.{turn}?"}],
                    max_tokens=12,
                    temperature=temperature,
                    n=2,
                    seed=10 * k + turn,
                )
            spans = http.post("/store/spans/query", json={"rollout_ids": [rollout_id]}).json()
            transitions += spans_to_transitions([Span(**s) for s in spans])
    for i, t in enumerate(transitions):
        t.advantage = 1.0 if i % 2 else -1.0
    return transitions


def test_the_first_update_on_fresh_rollouts_is_exactly_on_policy():
    transitions = _fresh_transitions(temperature=0.8)
    assert len(transitions) == 12 and all(t.temperature == 0.8 for t in transitions)
    trainer = LoRATrainer(TrainerConfig(model=str(tiny_model_dir()), learning_rate=1e-3))
    x, masked, _ = trainer._tensors([[t] for t in transitions])
    on = x["mask"].bool()
    with torch.no_grad():
        logp, _ = trainer._logprobs(x, masked)
        untempered = x | {"temperature": torch.ones_like(x["temperature"])}
        at_one, _ = trainer._logprobs(untempered, masked)
    ratio = (logp[on] - x["old"][on]).exp()
    assert (ratio - 1).abs().max() < 1e-3
    # At T = 1 the ratios were not 1: the temperature is what makes them so.
    assert ((at_one[on] - x["old"][on]).exp() - 1).abs().max() > 1e-2
    metrics = trainer.step(transitions)
    assert metrics["train/clip_frac"] == 0.0
