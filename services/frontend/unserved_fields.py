"""Request fields ferry does not serve (OpenAI's and vLLM's), refused with a 400 naming the field rather
than ignored: an answer without them would not be what the client asked for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.frontend import sampling_fields as fields
from services.frontend.request_error import RequestError
from services.frontend.request_error import json_type as _json_type
from services.frontend.request_error import shown
from services.frontend.sampling_fields import opt_bool
from services.frontend.tool_protocol import refuse_tool_calls

_OUTPUT_FLAGS = {"include_stop_str_in_output": False, "skip_special_tokens": True, "use_beam_search": False}
_UNSUPPORTED_SAMPLING = ("bad_words", "allowed_token_ids")  # vLLM's, refused unless empty
_REFUSED_FIELDS = {  # vLLM's, which change what is served: refused rather than ignored
    "chat_template": "a request's own chat template is not run (the model's is; vLLM takes one only with "
                     "--trust-request-chat-template)",
    "logits_processors": "logits processors are not run",
    "prompt_embeds": "prompts are taken as text or token ids, not embeddings",
    "guided_whitespace_pattern": "constrained JSON is written with one fixed whitespace (\", \" and \": \")",
}


def reject_unserved_completion_fields(body: Mapping[str, Any]) -> None:
    best_of = fields.opt_int(body, "best_of", low=1)
    if best_of not in (None, 1):
        raise RequestError(f"best_of: only best_of=1 is supported, got {best_of}", param="best_of")
    if body.get("suffix") is not None:
        raise RequestError("suffix: not supported; leave it out", param="suffix")
    refuse_tool_calls(body)
    _reject_unserved_output(body)


def reject_unserved_chat_fields(body: Mapping[str, Any]) -> None:
    if opt_bool(body, "echo"):  # vLLM's chat echo (the last message's text first) is not served
        raise RequestError("echo: not supported for chat completions (completions take it); leave it out",
                           param="echo")
    _reject_unserved_output(body)


def _reject_non_text_output(body: Mapping[str, Any]) -> None:
    """OpenAI's audio output: the model writes text only."""
    if body.get("audio") is not None:
        raise RequestError("audio: this model answers in text only; leave audio out", param="audio")
    modalities = body.get("modalities")
    if modalities is not None and not isinstance(modalities, list):
        raise RequestError(f"modalities: only [\"text\"] is supported, got {_json_type(modalities)}",
                           param="modalities")
    bad = next((i for i, m in enumerate(modalities or ()) if m != "text"), None)
    if bad is not None:
        raise RequestError(f"modalities[{bad}]: only [\"text\"] is supported, got {shown(modalities[bad])}",
                           param=f"modalities[{bad}]")


def _reject_unserved_output(body: Mapping[str, Any]) -> None:
    """Output options ferry would otherwise ignore are refused rather than answered without them."""
    _reject_non_text_output(body)
    for name in _UNSUPPORTED_SAMPLING:
        if body.get(name) not in (None, []):
            raise RequestError(f"{name}: not supported; leave it out", param=name)
    for name, why in _REFUSED_FIELDS.items():
        if body.get(name) is not None:
            raise RequestError(f"{name}: not supported: {why}; leave it out", param=name)
    for name, default in _OUTPUT_FLAGS.items():  # vLLM's output options; only their defaults are served
        if opt_bool(body, name) not in (None, default):
            raise RequestError(f"{name}: only {str(default).lower()} is supported; leave it out", param=name)
