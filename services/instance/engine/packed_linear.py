"""A linear layer whose weight can be prepacked for oneDNN.

On CPU, float32 `F.linear` goes to MKL's sgemm, which re-packs the weight on every
call and runs slow kernels on some CPUs (AMD EPYC: about half of oneDNN's speed
for 32-row decode batches and for the LM head). `pack()` reorders the weight once
into oneDNN's blocked layout and drops the plain copy; the output is the same
product up to float rounding. Packing is skipped, leaving the plain path, where
oneDNN does not apply (not CPU, not float32, or a torch without the ops), and for
small weights, where oneDNN's fixed cost per call (~25 us) outweighs its speed.
"""

import structlog
import torch
import torch.nn.functional as F
from torch import nn

log = structlog.get_logger(__name__)

MIN_PACKED_NUMEL = 1 << 16  # smaller weights stay plain: MKL is quicker for them


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    packed_weight: torch.Tensor | None = None  # oneDNN-blocked weight; while set, `weight` is None

    def pack(self, min_numel: int = MIN_PACKED_NUMEL) -> bool:
        """Replace the weight by its oneDNN-packed form; False (nothing changes) where that does not apply."""
        if self.packed_weight is not None:
            return True
        if self.weight.numel() < min_numel or not can_pack(self.weight):
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")
