"""A packed linear layer gives a row the same bits whatever the other rows in its batch (batch
invariance: a request decodes the same tokens alone, in a busy batch, and after a migration)."""

import pytest
import torch

from services.instance.engine.packed_linear import PackedLinear, can_pack

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="needs oneDNN on the CPU (float32)")]


@pytest.mark.parametrize("in_features,out_features", [(64, 192), (128, 16), (576, 1536), (1536, 576), (2048, 512)])
def test_a_rows_product_is_the_same_bits_in_any_batch(in_features, out_features):
    layer = PackedLinear(in_features, out_features, bias=False)
    torch.nn.init.normal_(layer.weight, std=0.05)
    assert layer.pack()
    rows = torch.randn(64, in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = layer(rows[5:6])[0]
        for batch, row in ((rows[4:6], 1), (rows[:7], 5), (rows[:33], 5), (rows, 5)):
            assert torch.equal(layer(batch)[row], alone), len(batch)
