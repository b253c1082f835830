"""Building a ready engine from a model folder: model, tokenizer, shared KV cache, engine.

On a CUDA device the weights and the KV cache live on the GPU (the cache shared through a
CUDA IPC handle); everything else, the scheduler's batches and sampling, stays on the host.

The torch engine loads the weights; the sim engine reads only config.json (and the
tokenizer) and runs a latency model instead (`sim_model.py`)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import structlog
import torch

from services.instance.engine.block_manager import max_blocks_held, num_blocks_for
from services.instance.engine.context_window import checked_max_model_len, kv_window
from services.instance.engine.engine import LLMEngine
from services.instance.engine.engine_config import EngineConfig
from services.instance.engine.kv_cache import KvCache, KvGeometry
from services.instance.engine.forward_batch import ForwardModel
from services.instance.engine.model import load_model
from services.instance.engine.model_config import ModelConfig
from services.instance.engine.model_fingerprint import fingerprint_if_readable, model_fingerprint
from services.instance.engine.sim_model import SimLatency, SimModel
from services.instance.engine.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    model_dir: pathlib.Path
    kv_name: str  # shared-memory segment name of the KV cache
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    num_blocks: int = 0  # 0 = size from kv_cache_mib
    kv_cache_mib: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0 = the longest the model serves (context_window.py)
    sim_latency: SimLatency | None = None  # set: the sim engine, with this latency model
    enable_prefix_caching: bool = True
    priority_headroom_blocks: int = 0  # EngineConfig.priority_headroom_blocks
    max_num_waiting: int = 0  # EngineConfig.max_num_waiting
    prefill_chunk_tokens: int = 0  # EngineConfig.prefill_chunk_tokens
    device: torch.device = torch.device("cpu")  # the torch engine's weights and KV cache (the sim engine: cpu)


@dataclass(slots=True)
class LoadedEngine:
    engine: LLMEngine
    kv_cache: KvCache
    max_model_len: int
    model_fingerprint: str = ""  # of the weights in its folder (model_fingerprint.py); "": the folder holds none

    def close(self) -> None:
        """Unmap and remove the shared KV memory (call once the engine is done)."""
        self.kv_cache.close()
        self.kv_cache.unlink()


def build_engine(spec: EngineSpec) -> LoadedEngine:
    # First: a file it cannot read leaves no KV memory behind (the sim engine reads no weights: it goes on).
    fingerprint = (model_fingerprint(spec.model_dir) if spec.sim_latency is None
                   else fingerprint_if_readable(spec.model_dir))
    log.info("model_fingerprinted", model_dir=str(spec.model_dir), model_fingerprint=fingerprint or None)
    model = _model(spec)
    config = model.config
    per_block = KvGeometry(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                           spec.block_size, 1, spec.dtype).bytes_per_block
    num_blocks = spec.num_blocks or max(1, spec.kv_cache_mib * 2**20 // per_block)
    max_model_len = fitted_max_model_len(checked_max_model_len(spec.max_model_len, config.context),
                                         is_explicit=spec.max_model_len > 0, kv_tokens=num_blocks * spec.block_size,
                                         window_tokens=_window_tokens(config, spec.block_size,
                                                                      spec.max_num_batched_tokens))
    geometry = KvGeometry(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                          spec.block_size, num_blocks, spec.dtype)
    kv_cache = KvCache.create(spec.kv_name, geometry, spec.device)
    kv_cache.prefault_in_background()  # blocks that migrate in are written by the transfer service, not touched here
    engine_config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, block_size=spec.block_size,
                                 max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                                 enable_prefix_caching=spec.enable_prefix_caching,
                                 priority_headroom_blocks=spec.priority_headroom_blocks,
                                 max_num_waiting=spec.max_num_waiting,
                                 prefill_chunk_tokens=spec.prefill_chunk_tokens)
    engine = LLMEngine(model, Tokenizer.from_dir(spec.model_dir), kv_cache, engine_config)
    return LoadedEngine(engine, kv_cache, max_model_len, fingerprint)


def _window_tokens(config: ModelConfig, block_size: int, max_num_batched_tokens: int) -> int | None:
    """With a sliding window on every layer, the KV tokens one sequence alone needs at most: its window's
    blocks and a whole step's tokens (a prefill chunk is admitted whole); None where some layer reads the
    whole context."""
    window = kv_window(config.layer_windows)
    if window is None:
        return None
    return (max_blocks_held(window + block_size, block_size, window)
            + num_blocks_for(max_num_batched_tokens, block_size)) * block_size


def fitted_max_model_len(max_model_len: int, *, is_explicit: bool, kv_tokens: int,
                         window_tokens: int | None = None) -> int:
    """The longest sequence this instance serves: no longer than its KV cache holds, since one
    request alone must always be able to finish. The model's own limit is lowered to it (and
    logged); an explicit --max-model-len above it is refused. With a sliding window on every layer,
    a request needs only `window_tokens` of KV (its window and a step): where they fit, any length does."""
    if max_model_len <= kv_tokens or (window_tokens is not None and window_tokens <= kv_tokens):
        return max_model_len
    if is_explicit:
        raise ValueError(f"--max-model-len {max_model_len} does not fit the KV cache, which holds {kv_tokens} tokens; "
                         "raise --kv-cache-mib (or --num-blocks) or lower --max-model-len")
    log.warning("max_model_len_lowered_to_kv_cache", model_limit=max_model_len, kv_tokens=kv_tokens,
                hint="raise --kv-cache-mib to serve the model's whole context")
    return kv_tokens


def _model(spec: EngineSpec) -> ForwardModel:
    if spec.sim_latency is not None:
        return SimModel(ModelConfig.from_dir(spec.model_dir), spec.sim_latency)
    return load_model(spec.model_dir, dtype=spec.dtype, device=spec.device)
