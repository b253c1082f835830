"""A chat request's messages and chat-template options, validated (the chat completions and
`/tokenize` bodies share them). Every problem raises `RequestError` (HTTP 400) naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.frontend.request_error import RequestError
from services.frontend.request_error import json_type as _json_type
from services.frontend.request_error import shown
from services.frontend.sampling_fields import opt_bool
from services.frontend.tool_protocol import checked_tools, message_tool_fields

MAX_TEMPLATE_KWARGS = 32
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """vLLM's chat extensions: `add_generation_prompt`, `continue_final_message` (the reply goes on
    from the last message's text, e.g. a prefilled assistant answer) and `chat_template_kwargs`
    (e.g. Qwen3's {"enable_thinking": false}), passed to the model's chat template."""

    add_generation_prompt: bool = True
    kwargs: tuple[tuple[str, Any], ...] = ()
    continue_final_message: bool = False


def chat_template_options(body: Mapping[str, Any]) -> ChatTemplateOptions:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"chat_template_kwargs: expected an object of at most {MAX_TEMPLATE_KWARGS} template "
                           "variables (not messages)", param="chat_template_kwargs")
    if "messages" in kwargs:
        raise RequestError("chat_template_kwargs.messages: the request's messages are the template's; leave it out",
                           param="chat_template_kwargs.messages")
    kwargs = dict(kwargs)
    options = {}
    for name in ("add_generation_prompt", "continue_final_message"):  # as vLLM: chat_template_kwargs wins
        in_kwargs = opt_bool(kwargs, name, param=f"chat_template_kwargs.{name}")
        kwargs.pop(name, None)
        options[name] = opt_bool(body, name) if in_kwargs is None else in_kwargs
    add_generation_prompt = options["add_generation_prompt"]
    continue_final_message = options["continue_final_message"] or False
    if continue_final_message and add_generation_prompt:
        raise RequestError("continue_final_message: cannot be true with add_generation_prompt true (the reply would "
                           "both start a new turn and go on with the last one); set add_generation_prompt to false",
                           param="continue_final_message")
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    if body.get("tools") and "tools" not in kwargs:  # shown to the model with any tool_choice
        kwargs["tools"] = checked_tools(body["tools"])
    return ChatTemplateOptions(add_generation_prompt, tuple(sorted(kwargs.items())), continue_final_message)


def chat_messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages: required (a list of {role, content} objects)", param="messages")
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else _json_type(messages)
        raise RequestError(f"messages: expected a non-empty list, got {got}", param="messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(message: Any, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{param}: expected an object with role and content, got {_json_type(message)}",
                           param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in _CHAT_ROLES:
        raise RequestError(f"{param}.role: expected one of {', '.join(sorted(_CHAT_ROLES))}, got {role!r}",
                           param=f"{param}.role")
    out = {"role": "system" if role == "developer" else role,  # OpenAI's newer name for system instructions
           "content": _content(message.get("content"), role, f"{param}.content")}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise RequestError(f"{param}.name: expected a string, got {_json_type(name)}", param=f"{param}.name")
        out["name"] = name
    return out | message_tool_fields(message, role, param)


def _content(content: Any, role: str, param: str) -> str | list[dict[str, str]]:
    """A string, or a list of text parts (`{"type": "text", "text": ...}`): the tokenizer passes it on to a
    template that loops over content and joins its texts with newlines for any other template."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        return [_text_part(part, f"{param}[{i}]") for i, part in enumerate(content)]
    raise RequestError(f"{param}: expected a string or a list of text parts, got {_json_type(content)}", param=param)


def _text_part(part: Any, param: str) -> dict[str, str]:
    """`{"type": "text", "text": ...}`; an error names the part's field that is wrong."""
    if not isinstance(part, dict):
        raise RequestError(f"{param}: expected a text part ({{\"type\": \"text\", \"text\": ...}}), got "
                           f"{_json_type(part)}", param=param)
    if part.get("type") != "text":
        raise RequestError(f"{param}.type: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, "
                           f"got {shown(part.get('type'))}", param=f"{param}.type")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{param}.text: expected a string, got {_json_type(part.get('text'))}", param=f"{param}.text")
    return {"type": "text", "text": part["text"]}
