"""A float32 model's linear layers on the CPU through oneDNN, their weights packed once at load.

``nn.Linear`` on a CPU calls the BLAS torch was built with (MKL), which on some CPUs takes a narrower
vector path than the machine has: on this project's AMD EPYC with AVX-512, a layer's product over 16
rows ran at ~90 GFLOPS through MKL and ~230 through oneDNN's packed product, and the 49152 x 576 LM
head read its weights at 17 against 39 GB/s for one row (``rocketkv-mt bench linear``). oneDNN's
product of a row also does not depend on the other rows of its call, so a session's logits in a
batched step are bit-identical to the ones it gets alone.
"""
from __future__ import annotations

import torch
from torch import nn

ROWS_HINT = 16  # rows the packing is laid out for (measured: 16 or more serves 1 to 400 rows alike)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the packed product can serve a model on ``device`` in ``dtype``."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over weights packed for oneDNN: x (..., in) -> (..., out)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Plain attributes, not parameters: the packed layout is opaque, and nothing trains or saves them.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` (in place); returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    packed = [PackedLinear(child) for _, _, child in targets]  # all packed before any is swapped in
    for (parent, name, _), layer in zip(targets, packed):
        setattr(parent, name, layer)
    return len(targets)
