"""A linear layer whose weight can be prepacked for oneDNN.

On CPU, float32 `F.linear` goes to MKL's sgemm, which re-packs the weight on every
call and runs slow kernels on some CPUs (AMD EPYC: about half of oneDNN's speed
for 32-row decode batches and for the LM head). `pack()` reorders the weight once
into oneDNN's blocked layout and drops the plain copy; the output is the same
product up to float rounding. Packing is skipped, leaving the plain path, where
oneDNN does not apply (not CPU, not float32, or a torch without the ops).

Batch invariance: a row's product must not depend on the other rows in the batch, or a
request would decode other tokens in a busy batch, or after a migration, than alone.
MKL's sgemm gives other bits for a row as the row count changes (any count, any shape
we tried); oneDNN's packed product gives the same bits for every count from 2 on (every
shape tried, 1 and 2 threads), but a single row goes another way where K >= 1536. So
every weight is packed, small ones too (oneDNN's fixed cost, ~25 us a call, is what
that costs), and a single row is computed as two where a probe when the weight is packed
finds its bits differ.
"""

import structlog
import torch
import torch.nn.functional as F
from torch import nn

log = structlog.get_logger(__name__)

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
    pads_lone_row: bool = False  # a single row goes another way than rows in a batch: compute it as two

    def pack(self) -> bool:
        """Replace the weight by its oneDNN-packed form; False (nothing changes) where that does not apply."""
        if self.packed_weight is not None:
            return True
        if not can_pack(self.weight):
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.weight = None
        self.pads_lone_row = not self._lone_row_is_batched()
        return True

    def _lone_row_is_batched(self) -> bool:
        """Whether a single row gets the bits it would get in a batch, probed once on this machine
        (the path depends on the shape and the CPU: here, K >= 1536 differed). Where it does, a lone
        row skips the copy into two rows (~10 us a call; the LM head's ~0.4 ms)."""
        rows = torch.randn(2, self.in_features, generator=torch.Generator().manual_seed(0))
        return torch.equal(self._packed(rows[:1]), self._packed(rows)[:1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1 and self.pads_lone_row:  # as a row of two: the same bits as in any batch (see above)
            return self._packed(torch.cat([x, x]))[:1]
        return self._packed(x.contiguous())

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
