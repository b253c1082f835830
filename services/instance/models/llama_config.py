"""The Hugging Face `config.json` / `generation_config.json` of a Llama-family model."""

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class LlamaShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True, slots=True)
class SpecialTokenIds:
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def config_json(shape: LlamaShape, ids: SpecialTokenIds) -> dict:
    """`config.json` for `LlamaForCausalLM` with float32 weights."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(shape),
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "rope_scaling": None,
        "bos_token_id": ids.bos_token_id,
        "eos_token_id": ids.eos_token_id,
        "pad_token_id": ids.pad_token_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def generation_config_json(ids: SpecialTokenIds) -> dict:
    return {
        "bos_token_id": ids.bos_token_id,
        "eos_token_id": ids.eos_token_id,
        "pad_token_id": ids.pad_token_id,
    }
