"""Tool calls in a chat answer's text: which format the model writes them in, and a parser
that splits the text, as it streams, into content and whole tool calls.

Three formats, as vLLM's parsers of the same names read them:

* `hermes` (Qwen2.5, Qwen3, Hermes, SmolLM3 and other templates that show `<tool_call>`):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them;
* `llama3_json` (Llama 3.1+): the whole answer is one or more JSON objects
  `{"name": ..., "parameters": {...}}`, separated by `;`;
* `mistral` (templates that show `[TOOL_CALLS]`): text, then `[TOOL_CALLS]` and the calls to the
  end of the answer, either a JSON list `[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B
  v0.3, Mixtral 8x22B) or `name[ARGS]{...}` for each call, each after a `[TOOL_CALLS]` of its
  own (Mistral Small 3.2, Devstral). `[TOOL_CALLS]` and `[ARGS]` are special tokens, left out of
  the text a client sees; a request that reads calls gets them in its answer's text
  (ServedModel.shown_marker_ids). Mistral's templates take call ids of 9 letters and digits
  only, so calls in this format get such ids.

`ToolCallParser` is fed the text as it streams and gives back the content that is now
certain and the tool calls completed; a whole answer is parsed by feeding it at once, so
a stream and a whole response say the same. Text that looks like a call and is not one
(bad JSON, no name) stays content: nothing the model wrote is lost.
"""

from __future__ import annotations

import enum
import json
import secrets
from dataclasses import dataclass, field
from typing import Any


class ToolCallFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"  # [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
    MISTRAL_ARGS = "mistral_args"  # [TOOL_CALLS]name[ARGS]{...} per call

    @property
    def is_mistral(self) -> bool:
        return self in (ToolCallFormat.MISTRAL, ToolCallFormat.MISTRAL_ARGS)


class ToolCallParserSetting(enum.Enum):
    """The frontend's --tool-call-parser."""

    AUTO = "auto"  # the format the model's chat template shows, if any
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    NONE = "none"  # parse no tool calls: tools are refused unless tool_choice is "none"

    def format_for(self, chat_template: str | None) -> ToolCallFormat | None:
        if self is ToolCallParserSetting.AUTO:
            return detect_format(chat_template)
        if self is ToolCallParserSetting.MISTRAL:  # which of its two shapes: the template shows it
            return ToolCallFormat.MISTRAL_ARGS if MISTRAL_ARGS in (chat_template or "") else ToolCallFormat.MISTRAL
        return None if self is ToolCallParserSetting.NONE else ToolCallFormat(self.value)


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MISTRAL_MARKERS = (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID)


def detect_format(chat_template: str | None) -> ToolCallFormat | None:
    """The format a chat template asks its model to call tools in; None if it shows none."""
    if not chat_template:
        return None
    if HERMES_OPEN in chat_template:  # with JSON inside; XML (Qwen3-Coder's <function=...>) is not read
        return None if "<function=" in chat_template else ToolCallFormat.HERMES
    if "<|python_tag|>" in chat_template or ('"parameters"' in chat_template and "ipython" in chat_template):
        return ToolCallFormat.LLAMA3_JSON
    if MISTRAL_CALLS in chat_template:
        return ToolCallFormat.MISTRAL_ARGS if MISTRAL_ARGS in chat_template else ToolCallFormat.MISTRAL
    return None


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse other ids when the call comes back."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


_ALPHANUMERIC = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it (a string)
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a piece of the answer gave: content now certain, tool calls now complete."""

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


def call_from_json(text: str, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from `{"name": ..., "arguments": {...}}` (None if it is not one)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call_from_object(value, arguments_keys)


def _call_from_object(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    return _call(value["name"], next((value[key] for key in arguments_keys if key in value), None))


def _call(name: str, arguments: Any, id_: str | None = None) -> ToolCall | None:
    """A call of `name` with `arguments` (a dict, its JSON text, or None for none); None if they are not an object."""
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text) if id_ is None else ToolCall(name, text, id_)


class ToolCallParser:
    """One choice's answer, fed as it streams, its last piece marked."""

    def __init__(self, format_: ToolCallFormat, max_calls: int | None = None,
                 hidden_markers: tuple[str, ...] = ()) -> None:
        self._format = format_
        self._max_calls = max_calls  # parallel_tool_calls false: 1 (later calls are dropped)
        self._hidden_markers = hidden_markers  # special tokens put back for the parser: left out of content again
        self._buffer = ""  # text not given back yet
        self._in_call = False  # hermes: inside <tool_call> ... (the opening tag is consumed)
        self._searched = 0  # hermes, inside a call: the buffer before this holds no closing tag
        self._held_whitespace = ""  # dropped if a call follows, given back if content does
        self._num_calls = 0
        self._is_json_answer: bool | None = None  # llama3_json: None until the first non-space character
        self._has_said = False  # some content went out already

    @property
    def has_called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str, is_last: bool = False) -> Parsed:
        """The next piece of the answer (`is_last`: the answer ends with it)."""
        self._buffer += text
        if self._format is ToolCallFormat.HERMES:
            parsed = self._hermes(is_final=is_last)
        elif self._format.is_mistral:
            parsed = self._mistral(is_final=is_last)
        else:
            parsed = self._llama3(is_final=is_last)
        content = parsed.content
        for marker in self._hidden_markers:  # text that was no call: as the client sees text, without them
            content = content.replace(marker, "")
        self._has_said = self._has_said or bool(content)
        return Parsed(content, parsed.tool_calls)

    # ---- hermes --------------------------------------------------------------------------

    def _hermes(self, is_final: bool) -> Parsed:
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(HERMES_CLOSE, self._searched)
                if end < 0 and not is_final:
                    self._searched = max(0, len(self._buffer) - len(HERMES_CLOSE) + 1)
                    break
                self._searched = 0
                body, self._buffer = (self._buffer[:end], self._buffer[end + len(HERMES_CLOSE):]) if end >= 0 \
                    else (self._buffer, "")
                self._in_call = False
                call = call_from_json(body.strip())
                if call is None:  # not a call after all: the model's text, as it wrote it
                    closing = HERMES_CLOSE if end >= 0 else ""
                    content.append(self._text(HERMES_OPEN + body + closing))
                else:
                    self._held_whitespace = ""  # what led up to the call
                    calls.extend(self._counted(call))
                continue
            start = self._buffer.find(HERMES_OPEN)
            if start >= 0:
                content.append(self._text(self._buffer[:start]))
                self._buffer, self._in_call = self._buffer[start + len(HERMES_OPEN):], True
                continue
            keep = 0 if is_final else _partial_tag_length(self._buffer, HERMES_OPEN)
            content.append(self._text(self._buffer[:len(self._buffer) - keep], is_final=is_final))
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return Parsed("".join(content), tuple(calls))

    def _text(self, text: str, is_final: bool = False) -> str:
        """Content to give back. Whitespace at its end waits to see what follows: content gets it,
        a call drops it, and so does the end of an answer that called a tool."""
        text = self._held_whitespace + text
        self._held_whitespace = ""
        if is_final:
            return text.rstrip() if self.has_called else text
        stripped = text.rstrip()
        self._held_whitespace = text[len(stripped):]
        return stripped

    def _counted(self, call: ToolCall) -> list[ToolCall]:
        if self._max_calls is not None and self._num_calls >= self._max_calls:
            return []
        self._num_calls += 1
        return [call]

    # ---- llama3_json ---------------------------------------------------------------------

    def _llama3(self, is_final: bool) -> Parsed:
        if self._is_json_answer is None:
            if not self._buffer.strip():
                return Parsed(self._buffer if is_final else "")
            self._is_json_answer = self._buffer.lstrip().startswith("{")
        if not self._is_json_answer:
            text, self._buffer = self._buffer, ""
            return Parsed(text)
        if not is_final:
            return Parsed()  # a call is only known whole at the end
        text, self._buffer = self._buffer, ""
        calls = _json_calls(text)
        if calls is None:
            return Parsed(text)
        return Parsed("", tuple(c for call in calls for c in self._counted(call)))

    # ---- mistral -------------------------------------------------------------------------

    def _mistral(self, is_final: bool) -> Parsed:
        """Content up to the first [TOOL_CALLS]; from there to the end, calls (known whole at the end)."""
        content = ""
        if not self._in_call:
            start = self._buffer.find(MISTRAL_CALLS)
            if start < 0:
                keep = 0 if is_final else _partial_tag_length(self._buffer, MISTRAL_CALLS)
                text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return Parsed(self._text(text, is_final=is_final))
            content = self._text(self._buffer[:start])
            self._buffer, self._in_call = self._buffer[start:], True
        if not is_final:
            return Parsed(content)
        text, self._buffer = self._buffer, ""
        read = _mistral_calls(text)
        if read is None:  # not calls after all: the model's text, as it wrote it
            return Parsed(content + self._held_whitespace + text)
        calls, after = read
        self._held_whitespace = ""
        if after and (content or self._has_said):
            after = " " + after
        return Parsed(content + after, tuple(c for call in calls for c in self._counted(call)))


def _mistral_calls(text: str) -> tuple[list[ToolCall], str] | None:
    """`[TOOL_CALLS] [{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]...` as calls, and the text after
    each JSON list (content, as vLLM reads it); None if any part is not a call. A name[ARGS] call whose arguments
    are empty or null, or a bare name, takes none: {} (as mistral-common writes them back)."""
    calls, afters = [], []
    for part in text.split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        if part.startswith("["):
            try:
                values, end = json.JSONDecoder().raw_decode(part)
            except ValueError:
                return None
            afters.append(part[end:].strip())
            found = [_call_from_object(v, ("arguments",)) for v in values] if isinstance(values, list) else [None]
            found = [call and ToolCall(call.name, call.arguments, mistral_call_id()) for call in found]
        else:
            name, _, arguments = part.partition(MISTRAL_ARGS)
            name, arguments = name.partition(MISTRAL_CALL_ID)[0].strip(), arguments.strip()
            is_name = bool(name) and not any(c.isspace() for c in name)
            found = [_call(name, None if arguments in ("", "null") else arguments, mistral_call_id())
                     if is_name else None]
        if not found or None in found:
            return None
        calls += found
    return (calls, " ".join(after for after in afters if after)) if calls else None


def _json_calls(text: str) -> list[ToolCall] | None:
    """`{...}; {...}` as calls, or None if any part is not one."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_from_object(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


def _partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
