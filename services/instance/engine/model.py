"""A Llama-family decoder (RMSNorm, RoPE, GQA, gated MLP) over a paged KV cache.

`LlamaModel.forward(batch, kv_cache)` runs one step: the packed new tokens of every
sequence go through all layers at once and the logits of each sequence's last
new token come back. Per forward, the attention plan (block gathers, masks) and
the RoPE cos/sin are computed once and shared by all layers; per layer the work
is a handful of big ops (fused q/k/v and gate/up projections). The LM head only
runs on the last token of each sequence (and on every token of a prefill chunk whose
request asked for prompt logprobs: `ForwardBatch.logit_lens`).

The KV cache is any tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`; `allocate_kv_cache` makes a plain one (the runtime may hand in one
that lives in shared memory instead).

The families' differences (model_config.py) are a few constants and switches: the MLP's
activation, Gemma's norm offset and embedding scale, Gemma 2's extra norms and soft-capping,
Granite's multipliers, partial RoPE, layers without RoPE (SmolLM3, Cohere 2, EXAONE 4); the
mixture-of-experts families swap the MLP of their sparse layers for `SparseMoeMLP`. The LayerNorm
families (StarCoder2, StableLM, Phi, GPT-NeoX, GPT-2, GPT-J, OPT, Falcon, OLMo, Cohere) take a
LayerNorm (`make_norm`), where not gated a `PlainMLP` (`make_mlp`), where their blocks are
parallel a `ParallelDecoderLayer`, and GPT-2 and OPT learned positions instead of RoPE. RoPE over
adjacent pairs of dims (Cohere, GPT-J, GLM, Helium, ERNIE) is served by permuting q/k rows at load
(weights.py), so one rotation serves every family.
"""

from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from services.instance.engine.attention import AttentionPlan, CacheGeometry, attend, write_kv
from services.instance.engine.forward_batch import ForwardBatch
from services.instance.engine.mlp import make_mlp
from services.instance.engine.model_config import GEMMA_TYPES, ModelConfig
from services.instance.engine.rope import RopeConfig, rope_inv_freq
from services.instance.engine.packed_linear import PackedLinear
from services.instance.engine.weights import load_state_dict

log = structlog.get_logger(__name__)


class RMSNorm(nn.Module):
    """RMSNorm scaling by its weight, or (Gemma) by `weight_offset + weight`. Normalized in float32; the scale is
    applied in the model's dtype after the cast (Llama), or in float32 before it (Gemma; OLMo2: `scales_in_float32`)."""

    def __init__(self, size: int, eps: float, weight_offset: float = 0.0, scales_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_offset = weight_offset
        self.scales_in_float32 = scales_in_float32

    @classmethod
    def of(cls, config: ModelConfig, size: int) -> "RMSNorm":
        """The family's norm over `size` features."""
        return cls(size, config.norm_eps, config.norm_weight_offset, config.norm_scales_in_float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_offset or self.scales_in_float32:
            scale = self.weight.float() + self.weight_offset
            return F.rms_norm(x.float(), self.weight.shape, scale, self.eps).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)  # in float32, as transformers does
        return self.weight * normed.to(x.dtype)


def make_norm(config: ModelConfig, size: int) -> nn.Module:
    """The family's norm over `size` features: a LayerNorm (with a weight and a bias; Cohere's without the bias,
    OLMo's with neither), or an RMSNorm."""
    if not config.layer_norm:
        return RMSNorm.of(config, size)
    return nn.LayerNorm(size, eps=config.norm_eps, elementwise_affine=config.norm_affine, bias=config.norm_bias)


class HeadwiseLayerNorm(nn.Module):
    """StableLM's q/k norms: a LayerNorm over each head (no bias), each head its own weights, scaled in float32
    (the bits of transformers' LayerNorm per head)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim]."""
        scale = self.weight.view(self.num_heads, self.head_dim).float()
        return (F.layer_norm(x.float(), (self.head_dim,), eps=self.eps) * scale).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables for every position the model serves, each [context_length, rotary_dim]: cos
    repeated for both halves, and sin negated on the first half, so that rotating x is
    `x * cos + x.roll(rotary_dim // 2) * sin` (the "rotate_half" convention of HF Llama); both
    scaled by the RoPE's attention factor (yarn, longrope)."""

    def __init__(self, config: ModelConfig, rope: RopeConfig) -> None:
        super().__init__()
        self.config = config
        self.rope = rope
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, dtype: torch.dtype, device: torch.device | str) -> None:
        positions = torch.arange(self.config.context_length, dtype=torch.int64).float()
        freqs = positions[:, None] * rope_inv_freq(self.rope)[None, :]
        factor = self.rope.attention_factor
        cos, sin = freqs.cos() * factor, freqs.sin() * factor
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype=dtype, device=device)
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the given positions, shaped [num_tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x ([num_tokens, heads, head_dim], may be a strided view) in place by position."""
    torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin, out=x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rope.rotary_dim
        self.scale = self.head_dim**-0.5 if config.attention_scale is None else config.attention_scale
        self.softcap = config.attention_softcap
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, qkv_size, bias=config.qkv_bias)
        self.o_proj = PackedLinear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm_per_head_weights:
            self.q_norm = HeadwiseLayerNorm(self.num_heads, self.head_dim, config.norm_eps)
            self.k_norm = HeadwiseLayerNorm(self.num_kv_heads, self.head_dim, config.norm_eps)
        elif config.qk_norm:
            self.q_norm = make_norm(config, self.head_dim)
            self.k_norm = make_norm(config, self.head_dim)
        elif config.qk_norm_full:
            self.q_norm = RMSNorm.of(config, self.num_heads * self.head_dim)
            self.k_norm = RMSNorm.of(config, self.num_kv_heads * self.head_dim)
        self.norms_each_head, self.norms_all_heads = config.qk_norm, config.qk_norm_full
        self.norms_after_rope = config.qk_norm_after_rope
        self.rotates = config.rotates(index)  # not with learned positions, nor on NoPE layers
        self.clip_qkv = config.clip_qkv

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_layer: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.norms_all_heads:
            self._normalize_projections_(qkv)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        qkv = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.norms_each_head and not self.norms_after_rope:
            self._normalize_heads_(qkv)
        if self.rotates:
            apply_rope_(qkv[:, : self.num_heads + self.num_kv_heads, : self.rotary_dim], *rope)
        if self.norms_after_rope:  # Hunyuan
            self._normalize_heads_(qkv)
        write_kv(kv_layer, qkv[:, self.num_heads :], plan.slot_mapping)
        return self.o_proj(attend(qkv[:, : self.num_heads], kv_layer, plan, self.scale, self.softcap))

    def _normalize_projections_(self, qkv: torch.Tensor) -> None:
        """OLMo2, OLMoE: RMSNorm over all query heads together and over all key heads, in place."""
        num_query = self.num_heads * self.head_dim
        queries, keys = qkv[:, :num_query], qkv[:, num_query:num_query + self.num_kv_heads * self.head_dim]
        queries.copy_(self.q_norm(queries))
        keys.copy_(self.k_norm(keys))

    def _normalize_heads_(self, qkv: torch.Tensor) -> None:
        """Qwen3, Gemma 3, EXAONE 4, Hunyuan: RMSNorm over head_dim of every query and key head, in place."""
        queries, keys = qkv[:, : self.num_heads], qkv[:, self.num_heads : self.num_heads + self.num_kv_heads]
        queries.copy_(self.q_norm(queries))
        keys.copy_(self.k_norm(keys))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Attention(config, index)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = make_mlp(config, index)
        self.residual_scale = config.residual_scale

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_layer: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        h = self._add_residual_(h, self.self_attn(self.input_layernorm(h), rope, kv_layer, plan))
        return self._add_residual_(h, self.mlp(self.post_attention_layernorm(h)))

    def _add_residual_(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return h.add_(out if self.residual_scale == 1.0 else out * self.residual_scale)


class ParallelDecoderLayer(DecoderLayer):
    """StableLM (use_parallel_residual), Phi, GPT-NeoX: attention and the MLP both read the block's input, normed
    once (StableLM, Phi: one norm shared) or each by its own norm (GPT-NeoX), and both outputs are added to it."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        if config.shared_block_norm:
            self.post_attention_layernorm = None
        self.adds_attention_first = config.parallel_adds_attention_first

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_layer: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        normed = self.input_layernorm(h)
        attended = self.self_attn(normed, rope, kv_layer, plan)
        mlp_out = self.mlp(normed if self.post_attention_layernorm is None else self.post_attention_layernorm(h))
        if self.adds_attention_first:
            return self._add_residual_(self._add_residual_(h, attended), mlp_out)
        return self._add_residual_(h, attended + mlp_out)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2: the attention and MLP outputs are normed too; `post_attention_layernorm` norms the
    attention's output (not the MLP's input, as in Llama)."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        self.pre_feedforward_layernorm = RMSNorm.of(config, config.hidden_size)
        self.post_feedforward_layernorm = RMSNorm.of(config, config.hidden_size)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_layer: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(h), rope, kv_layer, plan)
        h = self._add_residual_(h, self.post_attention_layernorm(attended))
        return self._add_residual_(h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))))


class PostNormDecoderLayer(DecoderLayer):
    """OLMo2: the attention and MLP outputs are normed before the residual add; their inputs are not."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        self.input_layernorm = None
        self.post_feedforward_layernorm = RMSNorm.of(config, config.hidden_size)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_layer: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        h = self._add_residual_(h, self.post_attention_layernorm(self.self_attn(h, rope, kv_layer, plan)))
        return self._add_residual_(h, self.post_feedforward_layernorm(self.mlp(h)))


def _uninitialized_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An embedding without nn.Embedding's random init: the checkpoint's tensor replaces its weight. That
    init (normal_) on the meta device imports torch's Python decompositions: ~1 s of CPU per instance start."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _uninitialized_embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = None
        if config.learned_positions:
            self.embed_positions = _uninitialized_embedding(config.max_position_embeddings, config.hidden_size)
        layer_class = SandwichDecoderLayer if config.sandwich_norms else \
            PostNormDecoderLayer if config.post_norms_only else \
            ParallelDecoderLayer if config.parallel_residual else DecoderLayer
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = None
        if not config.tie_word_embeddings or config.lm_head_bias:
            self.lm_head = PackedLinear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.rotary = RotaryEmbedding(config, config.rope)
        self.sliding_rotary = None if config.sliding_rope is None else RotaryEmbedding(config, config.sliding_rope)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pack_weights: bool = True,
    ) -> "LlamaModel":
        config = ModelConfig.from_dir(model_dir)
        with torch.device("meta"):
            model = cls(config)
        try:
            model.load_state_dict(load_state_dict(model_dir, config, dtype, device), strict=True, assign=True)
        except RuntimeError as exc:  # e.g. "size mismatch for ...": the config and the tensors disagree
            first = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc)[:300])
            raise ValueError(f"{model_dir}: the checkpoint's tensors do not have the shapes config.json gives "
                             "(check hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, "
                             f"head_dim and vocab_size): {first}") from None
        for rotary in (model.rotary, model.sliding_rotary):
            if rotary is not None:
                rotary.build(dtype, device)
        model.requires_grad_(False)
        num_packed = model.pack_weights() if pack_weights else 0
        log.info("model_loaded", model_dir=str(model_dir), dtype=str(dtype), device=str(device), num_packed=num_packed)
        return model.eval()

    def pack_weights(self) -> int:
        """Prepack the projections and the LM head for oneDNN (CPU float32; see packed_linear). A
        tied LM head gets its own packed copy of the embedding matrix. Returns how many weights
        were packed."""
        num_packed = sum(m.pack() for m in self.modules() if isinstance(m, PackedLinear))
        if self.lm_head is None:
            head = PackedLinear(self.config.hidden_size, self.config.vocab_size, bias=False, device="meta")
            head.weight = self.embed_tokens.weight
            if head.pack():
                self.lm_head = head
                num_packed += 1
        return num_packed

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """float32 host logits of the tokens `batch.logit_indices()` names (each sequence's last new token by
        default); writes the new K/V to kv_cache. The batch is host tensors; the model runs on the cache's device."""
        geometry, device = CacheGeometry.of(kv_cache), kv_cache.device
        plans = {window: AttentionPlan.build(batch.attention_view(), geometry, window).to(device)
                 for window in set(self.config.layer_windows)}
        positions = batch.positions.to(device)
        rope = self.rotary(positions)
        sliding_rope = rope if self.sliding_rotary is None else self.sliding_rotary(positions)
        h = self._embed(batch.input_ids.to(device), positions)
        for layer, kv_layer, window in zip(self.layers, kv_cache, self.config.layer_windows, strict=True):
            h = layer(h, rope if window is None else sliding_rope, kv_layer, plans[window])
        h = self.norm(h[batch.logit_indices().to(device)])
        logits = F.linear(h, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)
        if self.config.logits_scale != 1.0:
            logits = logits * self.config.logits_scale
        if self.config.logits_divisor != 1.0:
            logits = logits / self.config.logits_divisor
        if self.config.logits_softcap is not None:
            logits = torch.tanh(logits / self.config.logits_softcap) * self.config.logits_softcap
        return logits.float().cpu()  # sampling runs on the host, with the host RNG a migration carries

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            return h + self.embed_positions(positions)
        scale = self.config.embedding_scale
        if self.config.model_type in GEMMA_TYPES:  # transformers rounds sqrt(hidden_size) to the model's dtype first
            return h * torch.tensor(scale, dtype=h.dtype, device=h.device)
        return h if scale == 1.0 else h * scale


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    pack_weights: bool = True,
) -> LlamaModel:
    return LlamaModel.from_pretrained(model_dir, dtype=dtype, device=device, pack_weights=pack_weights)


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
    return (config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zeroed KV cache. Zeroed, not empty: masked-out keys must still be finite numbers."""
    return torch.zeros(kv_cache_shape(config, num_blocks, block_size), dtype=dtype, device=device)
