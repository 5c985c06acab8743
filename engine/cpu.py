"""CPU speed-up: run the model's linear layers through oneDNN with weights packed once at load.

A stock float32 nn.Linear on CPU calls a BLAS GEMM that re-packs the weight matrix on every call. At
batch 1 decoding the weights are the traffic, so the packing costs as much as the maths: packing once
made the bundled model's forward passes about 1.4x faster on our 2-core test machine, for one token and
for a verify pass alike (numbers in the README). This is what torch.compile's CPU "freezing" does,
without a compile step. Results match nn.Linear to float32 rounding (~1e-5).

The weight is packed without a batch-size hint. Packed for one row (hint 1), oneDNN runs a verify pass
of 2-5 rows ~1.5x slower than a one-row pass, which eats most of what speculation saves on a CPU. Packed
without a hint, the one-row pass is no slower and a 5-row pass costs ~1.2x one row, measured over the
bundled model's 211 weight shapes streamed from memory.

Used for float32 models on CPU only; SPECARENA_CPU_PACK=0 turns it off. Any failure leaves the
model as it was.
"""

from __future__ import annotations

import os

import torch


class PackedLinear(torch.nn.Module):
    """Inference-only stand-in for nn.Linear holding a oneDNN-packed weight."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())  # no batch hint: see above
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def enabled(model: torch.nn.Module) -> bool:
    param = next(model.parameters())
    return (
        os.environ.get("SPECARENA_CPU_PACK", "1") == "1"
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every nn.Linear for a PackedLinear in place; returns how many were packed (0 if not used)."""
    if not enabled(model):
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]  # fmt: skip
    try:
        packed = [(parent, name, PackedLinear(child)) for parent, name, child in targets]
        probe = packed[0][2] if packed else None
        if probe is not None:
            probe(torch.zeros(2, probe.in_features))
    except (RuntimeError, AttributeError):
        return 0
    for parent, name, module in packed:
        setattr(parent, name, module)
    return len(packed)
