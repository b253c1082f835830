"""Small KV geometries and random caches for transfer tests (no shared memory, no sockets)."""

from __future__ import annotations

import torch

from services.instance.engine.kv_cache import KvGeometry
from services.transfer.block_copy import kv_rows


def tiny_geometry(num_blocks: int = 12, dtype: torch.dtype = torch.float16) -> KvGeometry:
    # A block: 2 layers * 2 (K, V) = 4 rows of 4 tokens * 2 heads * 8 dims = 64 elements.
    return KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=num_blocks, dtype=dtype)


def random_kv(geometry: KvGeometry, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(geometry.shape, generator=generator).to(geometry.dtype)


def rows_of(kv: torch.Tensor) -> torch.Tensor:
    return kv_rows(kv)
