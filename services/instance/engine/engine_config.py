"""The engine's configuration (`EngineConfig`), checked when it is made and against the KV cache it runs on."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check_positive
from services.instance.engine.kv_cache import KvCache


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_blocks: int  # KV cache blocks; must match the KvCache's geometry
    max_model_len: int  # longest sequence, prompt + output
    block_size: int = 16  # tokens per KV block; must match the KvCache's geometry
    max_num_seqs: int = 64  # batch slots: most running requests
    max_num_batched_tokens: int = 2048  # most tokens (prefill chunks + decodes) in one step
    enable_prefix_caching: bool = True  # reuse the K/V of full blocks other requests computed (prefix_cache.py)
    priority_headroom_blocks: int = 0  # blocks each high-priority (priority > 0) request keeps out of freeness
    max_num_waiting: int = 0  # new requests queued for a batch slot beyond which more are refused; 0 = no bound
    prefill_chunk_tokens: int = 0  # prefill chunk boundaries (scheduler.py); 0 = half a step beside full decodes

    def __post_init__(self) -> None:
        check_positive(self, ("num_blocks", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"))
        if self.priority_headroom_blocks < 0:
            raise ValueError(f"--priority-headroom-blocks must be >= 0, got {self.priority_headroom_blocks}")
        if self.max_num_waiting < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0 (0 = no bound), got {self.max_num_waiting}")


def check_geometry(config: EngineConfig, kv_cache: KvCache) -> None:
    geometry = kv_cache.geometry
    if (geometry.num_blocks, geometry.block_size) != (config.num_blocks, config.block_size):
        raise ValueError(
            f"the KV cache has {geometry.num_blocks} blocks of {geometry.block_size} tokens but the engine was "
            f"configured with --num-blocks {config.num_blocks} --block-size {config.block_size}"
        )
