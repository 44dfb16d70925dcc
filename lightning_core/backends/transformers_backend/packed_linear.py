"""Linear layers computed by oneDNN from prepacked weights, for fast small-batch decoding on CPU."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """An nn.Linear computed by oneDNN from a prepacked copy of its weight.

    Decoding multiplies a few rows by every weight matrix; MKL's sgemm is slow at that shape
    (the 49k-row lm_head alone took 12 ms at batch 8, oneDNN packed takes 3 ms). It stays an
    nn.Linear, sharing the original parameters, so tied weights stay tied and PEFT still wraps
    it with LoRA.
    """

    @classmethod
    def wrap(cls, linear: nn.Linear) -> PackedLinear:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias
        # 8 is the batch size oneDNN tunes the layout for; it measured best from 1 to 32 rows.
        packed._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 8)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    """Replace every plain nn.Linear of `model` with a PackedLinear sharing its parameters."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear.wrap(child))


def can_pack(dtype: torch.dtype) -> bool:
    """Whether this torch build packs and runs linear weights of `dtype` (a probe layer)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = PackedLinear.wrap(nn.Linear(8, 8, dtype=dtype))
        probe(torch.zeros(2, 8, dtype=dtype))
    except (RuntimeError, AttributeError):
        return False
    return True
