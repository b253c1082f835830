"""Hugging Face checkpoints → the state dict of `LlamaModel`.

Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`; where a
folder has no safetensors, PyTorch's `pytorch_model.bin` (or the shards of
`pytorch_model.bin.index.json`), read with `torch.load(weights_only=True)`, which loads
tensors only, never pickled code. It renames the Hugging Face tensors to the model's and fuses q/k/v and gate/up into
one matrix each (Phi-3 checkpoints hold them fused already). Families whose tensors are named
otherwise get Llama's names renamed (`_RENAMES`); GPT-NeoX's fused q/k/v rows are regrouped and
GPT-2's Conv1D weights transposed (`_reordered`). Tensors are converted to the
requested dtype as they are read.
Extra tensors in the checkpoint (e.g. `rotary_emb.inv_freq`) are ignored; a
missing one is an error that names it.
"""

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from services.instance.engine.model_config import ModelConfig

log = structlog.get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_INDEX_FILE = "pytorch_model.bin.index.json"
PICKLE_PATTERN = "pytorch_model*.bin"


class _PickleReader:
    """A `pytorch_model*.bin` file with safe_open's reading interface (tensors memory-mapped)."""

    def __init__(self, path: Path) -> None:
        try:
            self._tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 — any unreadable file is the same error to the operator
            raise ValueError(f"{path}: not a PyTorch checkpoint of tensors ({exc})") from exc

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def _open(path: Path) -> AbstractContextManager:
    return nullcontext(_PickleReader(path)) if path.suffix == ".bin" else safe_open(path, framework="pt")


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Which file holds each tensor name."""
    model_dir = Path(model_dir)
    for index_file, pattern in ((INDEX_FILE, "*.safetensors"), (PICKLE_INDEX_FILE, PICKLE_PATTERN)):
        index = model_dir / index_file  # safetensors first: a pickle index left beside them is ignored
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: model_dir / file for name, file in weight_map.items()}
        if files := sorted(model_dir.glob(pattern)):
            return _names_in(files)
    raise ValueError(f"no *.safetensors (or {PICKLE_PATTERN}) in {model_dir}: "
                     "the torch engine loads Hugging Face checkpoints")


def _names_in(files: list[Path]) -> dict[str, Path]:
    names = {}
    for file in files:
        with _open(file) as reader:
            names.update({name: file for name in reader.keys()})
    return names


def _layer_sources(config: ModelConfig, i: int) -> Iterator[tuple[str, list[str]]]:
    """(model name, HF names concatenated along dim 0 to make it) for one decoder layer."""
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    fused = config.has_fused_checkpoint
    for s in ["weight"] + (["bias"] if config.qkv_bias else []):
        yield f"{ours}self_attn.qkv_proj.{s}", [f"{hf}self_attn.{p}_proj.{s}" for p in (["qkv"] if fused else "qkv")]
    for s in ["weight"] + (["bias"] if config.o_bias else []):
        yield f"{ours}self_attn.o_proj.{s}", [f"{hf}self_attn.o_proj.{s}"]
    if config.qk_norm_per_head_weights and config.model_type == "stablelm":  # Cohere's: one [heads, head_dim] tensor
        for norm, heads in (("q_norm", config.num_attention_heads), ("k_norm", config.num_key_value_heads)):
            yield f"{ours}self_attn.{norm}.weight", [f"{hf}self_attn.{norm}.norms.{h}.weight" for h in range(heads)]
    elif config.qk_norm or config.qk_norm_full:
        for norm in ("q_norm", "k_norm"):
            yield from _norm_sources(config, f"{ours}self_attn.{norm}", f"{hf}self_attn.{norm}")
    if config.moe is not None and config.moe.sparse_layers[i]:
        yield from _sparse_mlp_sources(config, hf, ours)
    else:
        for s in ["weight"] + (["bias"] if config.mlp_bias else []):
            if not config.gated_mlp:
                yield f"{ours}mlp.up_proj.{s}", [f"{hf}mlp.up_proj.{s}"]
            else:
                gate_up = ["gate_up"] if config.has_fused_gate_up else ["gate", "up"]
                yield f"{ours}mlp.gate_up_proj.{s}", [f"{hf}mlp.{p}_proj.{s}" for p in gate_up]
            yield f"{ours}mlp.down_proj.{s}", [f"{hf}mlp.down_proj.{s}"]
    norms = ([] if config.post_norms_only else ["input"]) + ([] if config.shared_block_norm else ["post_attention"])
    norms += ["pre_feedforward", "post_feedforward"] if config.sandwich_norms else []
    norms += ["post_feedforward"] if config.post_norms_only else []
    for norm in norms:
        yield from _norm_sources(config, f"{ours}{norm}_layernorm", f"{hf}{norm}_layernorm")


def _norm_sources(config: ModelConfig, ours: str, hf: str) -> Iterator[tuple[str, list[str]]]:
    """A norm's weight, and its bias where it is a LayerNorm with one (OLMo's norms have neither)."""
    if not config.norm_affine:
        return
    for s in ["weight"] + (["bias"] if config.layer_norm and config.norm_bias else []):
        yield f"{ours}.{s}", [f"{hf}.{s}"]


def _sparse_mlp_sources(config: ModelConfig, hf: str, ours: str) -> Iterator[tuple[str, list[str]]]:
    """A mixture-of-experts layer: the router, each expert (Mixtral's w1/w3/w2 are gate/up/down), and
    Qwen2-MoE's shared expert and its gate."""
    mixtral = config.model_type == "mixtral"
    block = f"{hf}block_sparse_moe." if mixtral else f"{hf}mlp."
    gate_up, down = (["w1", "w3"], "w2") if mixtral else (["gate_proj", "up_proj"], "down_proj")
    yield f"{ours}mlp.gate.weight", [f"{block}gate.weight"]
    for e in range(config.moe.num_experts):
        yield f"{ours}mlp.experts.{e}.gate_up_proj.weight", [f"{block}experts.{e}.{p}.weight" for p in gate_up]
        yield f"{ours}mlp.experts.{e}.down_proj.weight", [f"{block}experts.{e}.{down}.weight"]
    if config.moe.shared_intermediate_size:
        yield f"{ours}mlp.shared_expert.gate_up_proj.weight", [f"{block}shared_expert.{p}_proj.weight"
                                                              for p in ("gate", "up")]
        yield f"{ours}mlp.shared_expert.down_proj.weight", [f"{block}shared_expert.down_proj.weight"]
        yield f"{ours}mlp.shared_expert_gate.weight", [f"{block}shared_expert_gate.weight"]


# Each family's tensor names where they differ from Llama's: (Llama's part, the family's), replaced in order.
_RENAMES = {
    "starcoder2": (("mlp.up_proj.", "mlp.c_fc."), ("mlp.down_proj.", "mlp.c_proj.")),
    "stablelm": (("self_attn.q_norm.", "self_attn.q_layernorm."), ("self_attn.k_norm.", "self_attn.k_layernorm.")),
    "phi": (("self_attn.q_norm.", "self_attn.q_layernorm."), ("self_attn.k_norm.", "self_attn.k_layernorm."),
            ("self_attn.o_proj.", "self_attn.dense."), ("mlp.up_proj.", "mlp.fc1."), ("mlp.down_proj.", "mlp.fc2."),
            ("model.norm.", "model.final_layernorm.")),
    "gpt2": (("model.embed_tokens.", "transformer.wte."), ("model.norm.", "transformer.ln_f."),
             ("model.layers.", "transformer.h."), ("self_attn.qkv_proj.", "attn.c_attn."),
             ("self_attn.o_proj.", "attn.c_proj."), ("mlp.up_proj.", "mlp.c_fc."), ("mlp.down_proj.", "mlp.c_proj."),
             ("input_layernorm.", "ln_1."), ("post_attention_layernorm.", "ln_2.")),
    "gptj": (("model.embed_tokens.", "transformer.wte."), ("model.norm.", "transformer.ln_f."),
             ("model.layers.", "transformer.h."), ("self_attn.o_proj.", "attn.out_proj."), ("self_attn.", "attn."),
             ("mlp.up_proj.", "mlp.fc_in."), ("mlp.down_proj.", "mlp.fc_out."), ("input_layernorm.", "ln_1.")),
    "falcon": (("model.embed_tokens.", "transformer.word_embeddings."), ("model.norm.", "transformer.ln_f."),
               ("model.layers.", "transformer.h."), ("self_attn.qkv_proj.", "self_attention.query_key_value."),
               ("self_attn.o_proj.", "self_attention.dense."), ("mlp.up_proj.", "mlp.dense_h_to_4h."),
               ("mlp.down_proj.", "mlp.dense_4h_to_h.")),
    # GLM-4: its norm after attention, before the MLP and after it (Gemma 2's post_attention, pre_ and post_feedforward)
    "glm4": (("post_attention_layernorm.", "post_self_attn_layernorm."),
             ("pre_feedforward_layernorm.", "post_attention_layernorm."),
             ("post_feedforward_layernorm.", "post_mlp_layernorm.")),
    "hunyuan_v1_dense": (("self_attn.q_norm.", "self_attn.query_layernorm."),
                         ("self_attn.k_norm.", "self_attn.key_layernorm.")),
    "opt": (("model.norm.", "model.decoder.final_layer_norm."), ("model.embed_tokens.", "model.decoder.embed_tokens."),
            ("model.layers.", "model.decoder.layers."), ("self_attn.o_proj.", "self_attn.out_proj."),
            ("mlp.up_proj.", "fc1."), ("mlp.down_proj.", "fc2."), ("input_layernorm.", "self_attn_layer_norm."),
            ("post_attention_layernorm.", "final_layer_norm.")),
    "gpt_neox": (("model.embed_tokens.", "gpt_neox.embed_in."), ("model.norm.", "gpt_neox.final_layer_norm."),
                 ("model.layers.", "gpt_neox.layers."), ("self_attn.qkv_proj.", "attention.query_key_value."),
                 ("self_attn.o_proj.", "attention.dense."), ("mlp.up_proj.", "mlp.dense_h_to_4h."),
                 ("mlp.down_proj.", "mlp.dense_4h_to_h."), ("lm_head.", "embed_out.")),
}


_POSITIONS = {"gpt2": "transformer.wpe.weight", "gpt_bigcode": "transformer.wpe.weight",
              "opt": "model.decoder.embed_positions.weight"}  # learned positions
OPT_POSITION_OFFSET = 2  # OPT's position p is row p + 2 of its table


# Falcon's new decoder architecture (two norms per parallel block): attention's and the MLP's
_FALCON_TWO_NORMS = (("input_layernorm.", "ln_attn."), ("post_attention_layernorm.", "ln_mlp."))


def _renames(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    renames = _RENAMES.get("gpt2" if config.model_type == "gpt_bigcode" else config.model_type, ())
    if config.model_type == "falcon" and config.parallel_residual and not config.shared_block_norm:
        return renames + _FALCON_TWO_NORMS
    return renames


def tensor_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Every model tensor and the HF tensors it is made of."""
    sources = {"embed_tokens.weight": ["model.embed_tokens.weight"]}
    sources.update(_norm_sources(config, "norm", "model.norm"))
    if config.learned_positions:
        sources["embed_positions.weight"] = [_POSITIONS[config.model_type]]
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    if config.lm_head_bias:  # a head of its own, its weight the embedding matrix where tied
        sources["lm_head.weight"] = ["lm_head.weight" if not config.tie_word_embeddings else "model.embed_tokens.weight"]
        sources["lm_head.bias"] = ["lm_head.bias"]
    for i in range(config.num_hidden_layers):
        sources.update(_layer_sources(config, i))
    renames = _renames(config)
    return {name: [_renamed(hf, renames) for hf in parts] for name, parts in sources.items()}


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for llama, family in renames:
        name = name.replace(llama, family)
    return name


def _checkpoint_name(hf: str, files: dict[str, Path]) -> str:
    """The name as the checkpoint spells it: GPT-2's first checkpoints leave out the `transformer.` prefix, OPT's
    the `model.` one."""
    bare = hf.removeprefix("transformer.").removeprefix("model.")
    return bare if hf not in files and bare in files else hf


def _reordered(config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's and Falcon's fused q/k/v rows run group by group (`_ungrouped`); the model's run all queries, then
    all keys, then all values. GPT-2's Conv1D weights are stored [in, out]. Interleaved
    RoPE (Cohere) rotates dims (2i, 2i + 1) of each head, the model's (i, i + rotary_dim / 2): each query and key
    head's rows (and its q/k norm weights, flattened from [heads, head_dim]) are permuted to match. The attention
    scores are the same sums in another order; the cached keys are permuted too, which nothing outside reads."""
    if config.rope_interleaved and (".qkv_proj." in name or "_norm.weight" in name and ".self_attn." in name):
        return _deinterleaved(config, tensor.flatten() if tensor.dim() == 2 and "_norm." in name else tensor)
    if config.model_type == "gpt2" and name.endswith("_proj.weight"):
        return tensor.t().contiguous()
    if config.model_type == "opt" and name == "embed_positions.weight":
        return tensor[OPT_POSITION_OFFSET:]
    if config.model_type not in ("gpt_neox", "falcon", "gpt_bigcode") or ".qkv_proj." not in name:
        return tensor
    return _ungrouped(tensor, config.num_key_value_heads, config.num_queries_per_kv, config.head_dim)


def _ungrouped(tensor: torch.Tensor, groups: int, queries_per_group: int, head_dim: int) -> torch.Tensor:
    """Fused q/k/v rows that run group by group, each its queries, its key and its value
    ([groups, queries_per_group + 2, head_dim]: GPT-NeoX's and multi-head Falcon's and GPT-BigCode's with one query a
    group, their multi-query forms with one group), as the model's: all queries, then all keys, then all values."""
    grouped = tensor.reshape(groups, queries_per_group + 2, head_dim, -1)
    parts = (grouped[:, :queries_per_group], grouped[:, queries_per_group:-1], grouped[:, -1:])
    return torch.cat([part.reshape(-1, *tensor.shape[1:]) for part in parts])


def _deinterleaved(config: ModelConfig, tensor: torch.Tensor) -> torch.Tensor:
    """The rows of every query and key head (the leading ones: the q/k/v projections' rows run queries, keys,
    values) with each head's rotated dims ordered evens first, then odds; values' rows are left as they are."""
    head_dim, rotary_dim = config.head_dim, config.rope.rotary_dim
    order = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_dim)))
    num_rotated = min(tensor.shape[0], (config.num_attention_heads + config.num_key_value_heads) * head_dim)
    rotated = tensor[:num_rotated].unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)
    return torch.cat((rotated, tensor[num_rotated:]))


def _warn_if_tied_head_differs(config: ModelConfig, files: dict[str, Path], readers: dict, state: dict) -> None:
    """With `tie_word_embeddings` the head is the embedding matrix (as vLLM serves it) and a checkpoint's own
    `lm_head.weight` goes unused; say so where that tensor differs (transformers 5 keeps it instead, so its
    outputs differ from ours)."""
    head = _renamed("lm_head.weight", _renames(config))
    if not config.tie_word_embeddings or config.lm_head_bias or head not in files:
        return
    embedding = state["embed_tokens.weight"]
    if not torch.equal(readers[files[head]].get_tensor(head).to(embedding.dtype).to(embedding.device), embedding):
        log.warning("tied_lm_head_ignored", tensor=head, reason="config.json sets tie_word_embeddings, so the "
                    "head is the embedding matrix; the checkpoint's head differs from it and is not used "
                    "(set tie_word_embeddings to false to serve it)")


def load_state_dict(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    files = checkpoint_files(model_dir)
    sources = {name: [_checkpoint_name(hf, files) for hf in parts] for name, parts in tensor_sources(config).items()}
    missing = sorted(hf for parts in sources.values() for hf in parts if hf not in files)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {shown}")
    state = {}
    with ExitStack() as stack:
        readers = {f: stack.enter_context(_open(f)) for f in set(files.values())}
        for name, parts in sources.items():
            tensors = [readers[files[hf]].get_tensor(hf).to(dtype) for hf in parts]
            state[name] = _reordered(config, name, tensors[0] if len(tensors) == 1 else torch.cat(tensors)).to(device)
        _warn_if_tied_head_differs(config, files, readers, state)
    log.info("weights_loaded", model_dir=str(model_dir), num_tensors=len(state), num_files=len(readers))
    return state
