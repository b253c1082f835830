"""The decoder layers' feed-forward blocks: gated (SwiGLU, GeGLU), plain (the LayerNorm families), and
sparse mixture-of-experts, with the activations the families use, each giving transformers' bits."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.instance.engine.model_config import ModelConfig
from services.instance.engine.packed_linear import PackedLinear


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation (GPT-2, Phi): the tanh approximation, written out (other bits than F.gelu's)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": gelu_new,
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),  # transformers' ReLUSquaredActivation (Arcee)
}


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)) (SwiGLU with silu, GeGLU with gelu), gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, 2 * size, bias=config.mlp_bias)
        self.down_proj = PackedLinear(size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))  # the activation's own output: multiplied in place


class PlainMLP(nn.Module):
    """Not gated: down(act(up(x))) (StarCoder2, Phi, GPT-NeoX, GPT-2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up_proj = PackedLinear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = PackedLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def make_mlp(config: ModelConfig, index: int) -> nn.Module:
    """Layer `index`'s MLP: sparse (mixture of experts), gated or plain."""
    if config.moe and config.moe.sparse_layers[index]:
        return SparseMoeMLP(config)
    return MLP(config) if config.gated_mlp else PlainMLP(config)


class SparseMoeMLP(nn.Module):
    """Mixtral, Qwen2/3-MoE, as transformers runs them: the router's softmax (in float32) picks each
    token's top k experts, renormalized over those k where the family does; each expert, a gated MLP,
    runs on the tokens routed to it, and its outputs are added in expert order, weighted, in float32
    and rounded to the model's dtype once (as transformers' grouped experts do). A token's sum so
    depends on its own routing only (batch invariance), and each expert's matmuls are packed like
    every other (packed_linear). Qwen2-MoE adds a shared expert, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.top_k, self.renormalize, self.rounds_weights = moe.top_k, moe.renormalize, moe.rounds_weights
        self.gate = PackedLinear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, moe.expert_intermediate_size) for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(config, moe.shared_intermediate_size)
            self.shared_expert_gate = PackedLinear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.rounds_weights:
            weights = weights.to(x.dtype)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = chosen.flatten()  # (token, slot) pairs, token-major
        picks = flat.argsort(stable=True)  # grouped by expert, in token order
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one device sync a layer
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            group, start = picks[start:start + count], start + count
            tokens, slots = group // self.top_k, group % self.top_k
            out.index_add_(0, tokens, (self.experts[expert](x[tokens]) * weights[tokens, slots, None]).float())
        out = out.to(x.dtype)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
