"""Texts run through an llguidance grammar token by token, as the engine's mask would let a
model write them: SmolLM2's tokenizer where `models/` holds it (real multi-character tokens),
else the tiny test model's byte-level one."""

from __future__ import annotations

import json
import pathlib

import llguidance

SMOLLM2_TOKENIZER = pathlib.Path("models/smollm2-135m-instruct/tokenizer.json")


class GrammarMatching:
    def __init__(self, tokenizer_json: pathlib.Path, vocab_size: int, eos_token_id: int) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size,
                                                eos_token=[eos_token_id])

    def accepts(self, grammar: str, text: str) -> bool:
        """The grammar lets each of `text`'s tokens through and is complete after the last."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(self.tokenizer.tokenize_str(text)) and matcher.is_accepting()

    @classmethod
    def of_test_models(cls, tiny_model_dir: pathlib.Path) -> GrammarMatching:
        if SMOLLM2_TOKENIZER.is_file():
            return cls(SMOLLM2_TOKENIZER, 49152, 2)
        config = json.loads((tiny_model_dir / "config.json").read_text())
        return cls(tiny_model_dir / "tokenizer.json", config["vocab_size"], config["eos_token_id"])
