"""The tests' own trained models (tests/models.py) learn what they are taught, on any machine.

Issue 43: the judge calibration test failed on a fresh clone ("the tiny test model did not learn
its answers", loss 4.20 / 2.74): its examples hold the transcripts a sampling policy wrote, which
differ from machine to machine, and the old recipe (AdamW at 1e-2, stopped on a loss threshold)
learned only some sets of them. Set 1, agreeing, on the verdict prompt the judge had then
(benchmarks/tiny_answerer.py --prompt plain) is one it did not learn here: after its 400 steps
the loss was 1.91 and a greedy answer wrong. Any set must be learned, and the same way on every
run: that set, trained twice.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.tiny_answerer import example_set
from lightning_core.models import tiny_model_dir
from tests.models import _train_answers


@pytest.mark.timeout(300)
def test_the_answering_model_learns_a_set_the_old_recipe_did_not_and_the_same_way_twice(
    tmp_path,
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    examples = example_set(tokenizer, seed=1, agree=True, prompt="plain")
    folders = [tmp_path / "first", tmp_path / "second"]
    for folder in folders:
        _train_answers(folder, examples, 400)  # RuntimeError if greedy decoding misses one
    first, second = (AutoModelForCausalLM.from_pretrained(f).state_dict() for f in folders)
    assert all(torch.equal(first[name], second[name]) for name in first)
