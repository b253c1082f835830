"""`tokenizer_config.json` for a folder whose tokenizer is a `tokenizer.json`."""

from tokenizers import Tokenizer


def tokenizer_config_json(
    tokenizer: Tokenizer,
    *,
    bos: str,
    eos: str,
    pad: str,
    unk: str | None = None,
    chat_template: str,
    model_max_length: int,
) -> dict:
    """Special tokens by content, the added tokens by id, and the chat template."""
    added = {
        str(token_id): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for token_id, tok in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [tok["content"] for tok in added.values() if tok["special"]],
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }
