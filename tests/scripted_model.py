"""A real model folder whose greedy answer to any chat prompt is a script of our choosing.

Built from the tiny MHA Llama: each piece of the script becomes a token of its own (an
added, non-special token, so it decodes as its text), attention and MLP outputs are
zeroed so the last hidden state is the current token's embedding, and the LM head maps
each token of the chain (the chat prompt's last token, then each piece) to the next one,
the last piece to end-of-sequence. The torch engine runs it like any other model: this is
how tests see what the serving path does with an answer they know in advance (tool calls).
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Sequence

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer as HfTokenizer

from services.instance.engine.tokenizer import Tokenizer
from services.instance.models.tiny import TINY_IDS, build_tiny_model

LOGIT_SCALE = 50.0


def build_scripted_model(out_dir: pathlib.Path, script: Sequence[str], chat_template: str,
                         special: Sequence[str] = ()) -> pathlib.Path:
    """`special`: pieces added as special tokens (left out of output text, as Mistral's [TOOL_CALLS])."""
    base = build_tiny_model(out_dir.with_name(out_dir.name + "-base"), "mha-untied", seed=0)
    shutil.copytree(base, out_dir)
    piece_ids = _add_piece_tokens(out_dir, script, special)
    _set_chat_template(out_dir, chat_template)
    prompt_ids = Tokenizer.from_dir(out_dir).encode_chat([{"role": "user", "content": "hi"}])
    chain = [prompt_ids[-1], *piece_ids]
    _grow_vocabulary(out_dir, max(piece_ids) + 1)
    _script_weights(out_dir, chain, [*piece_ids, TINY_IDS.eos_token_id])
    return out_dir


def _grow_vocabulary(folder: pathlib.Path, vocab_size: int) -> None:
    """Room for the added tokens in config.json and the embedding and LM head (new rows zero)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if vocab_size <= config["vocab_size"]:
        return
    config["vocab_size"] = vocab_size
    path.write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        old = tensors[name]
        tensors[name] = torch.cat([old, old.new_zeros(vocab_size - old.shape[0], old.shape[1])])
    save_file(tensors, folder / "model.safetensors")


def _add_piece_tokens(folder: pathlib.Path, script: Sequence[str], special: Sequence[str]) -> list[int]:
    tokenizer = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in special])
    tokenizer.add_tokens([AddedToken(piece, special=False, normalized=False) for piece in script if piece not in special])
    (folder / "tokenizer.json").write_text(tokenizer.to_str())
    ids = [tokenizer.token_to_id(piece) for piece in script]
    if len(set(ids)) != len(ids):
        raise ValueError("every piece of the script must be different")
    return ids


def _set_chat_template(folder: pathlib.Path, chat_template: str) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = chat_template
    path.write_text(json.dumps(config))


def _script_weights(folder: pathlib.Path, chain: list[int], successors: list[int]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    if len(chain) > hidden:
        raise ValueError(f"a script of {len(chain) - 1} pieces needs more than {hidden} hidden dimensions")
    for name in tensors:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])  # the residual stream keeps the token's embedding
    lm_head = torch.zeros_like(tensors["lm_head.weight"])
    for k, (token_id, successor) in enumerate(zip(chain, successors)):
        tensors["model.embed_tokens.weight"][token_id] = torch.nn.functional.one_hot(torch.tensor(k), hidden).float()
        lm_head[successor, k] = LOGIT_SCALE
    tensors["lm_head.weight"] = lm_head
    save_file(tensors, path)
