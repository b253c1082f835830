"""A Hugging Face tokenizer folder without transformers: `tokenizer.json`,
`tokenizer_config.json` (special tokens, chat template), and the end-of-sequence
ids that `config.json` and `generation_config.json` add.

The chat template is rendered the way transformers renders it: a sandboxed jinja2
environment with `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a
`{% generation %}` block that renders its body (transformers' assistant-mask marker), a
`tojson` filter that keeps non-ASCII text, `raise_exception`/`strftime_now` globals, and
`tools`/`documents` defined (null when a request has none) beside every special token
tokenizer_config.json names. Text produced by `apply_chat_template` already holds the template's
special tokens, so `encode_chat` encodes it without adding more.
"""

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import structlog
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = structlog.get_logger(__name__)

REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's token for one raw byte
_MAX_UTF8_CONTINUATION_BYTES = 3  # after a character's first byte
_DETOKENIZER_CONTEXT = 4  # prompt ids an output is decoded after (detokenizer_context)
# the special tokens transformers passes to a chat template (its SPECIAL_TOKENS_ATTRIBUTES)
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        tool_use_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.tool_use_template = tool_use_template  # a named "tool_use" template: for requests with tools
        self.special_tokens = dict(special_tokens or {})  # "bos_token" → "<s>", ...
        self.eos_token_ids = tuple(eos_token_ids)
        decoder_types = _decoder_types(backend)  # parses the whole tokenizer JSON: once
        self._is_byte_level = decoder_types >= {"ByteLevel"}
        added = backend.get_added_tokens_decoder()
        self._added_token_ids = frozenset(added)  # special and added: plain text
        self._special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self._raw_byte_ids = (_raw_byte_ids(backend) if "ByteFallback" in decoder_types else frozenset()) \
            - self._added_token_ids
        self._anchor_id = _mid_text_anchor(backend, self._added_token_ids)
        self._anchor_text = "" if self._anchor_id is None else backend.decode([self._anchor_id],
                                                                             skip_special_tokens=False)
        self._template = _chat_template(chat_template) if chat_template else None
        self._tool_use_template = _chat_template(tool_use_template) if tool_use_template else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {model_dir}: the model folder needs a fast tokenizer file")
        backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {k: t for k in _SPECIAL_TOKEN_NAMES if (t := _token(config.get(k)))}
        eos_ids = [
            *_ids(_read_json(model_dir / "config.json").get("eos_token_id")),
            *_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id")),
        ]
        if "eos_token" in special and (eos_id := backend.token_to_id(special["eos_token"])) is not None:
            eos_ids.append(eos_id)
        default, tool_use = _chat_templates(model_dir, config)
        tokenizer = cls(backend, default, special, dict.fromkeys(eos_ids), tool_use)
        log.info("tokenizer_loaded", model_dir=str(model_dir), eos_token_ids=tokenizer.eos_token_ids)
        return tokenizer

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works, encode does not: a 1 MB prompt held it for
        # 1.6 s, freezing the frontend's event loop (every stream, /health, the etcd lease) although
        # it ran in a worker thread.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_raw_byte(self, token_id: int) -> bool:
        """A SentencePiece byte-fallback token (<0xNN>): its decoder decodes a run of them together,
        and a run that is not valid UTF-8 becomes one U+FFFD per byte."""
        return token_id in self._raw_byte_ids

    def detokenizer_context(self, prompt_ids: Sequence[int]) -> tuple[int, ...]:
        """The prompt's last ids an output is decoded after (so its first token decodes as a continuation:
        a leading space, a character split across tokens): the last 4, or up to 3 more where those start
        inside a character spelled in <0xNN> tokens. The decoder turns a run of them that is not valid
        UTF-8 into one U+FFFD per byte, so from mid-character an output going on with raw bytes (a Chinese
        answer to a Chinese prompt on Llama 2 or Mistral) came out U+FFFD until its first other token."""
        start = max(0, len(prompt_ids) - _DETOKENIZER_CONTEXT)
        for _ in range(_MAX_UTF8_CONTINUATION_BYTES):
            if start == 0 or not self._is_mid_character_byte(prompt_ids[start]):
                break
            start -= 1
        return tuple(prompt_ids[start:])

    def _is_mid_character_byte(self, token_id: int) -> bool:
        """A <0xNN> token of a UTF-8 continuation byte (0x80-0xBF), which never starts a character."""
        return self.is_raw_byte(token_id) and 0x80 <= self.token_bytes(token_id)[0] <= 0xBF

    def is_special(self, token_id: int) -> bool:
        """A special token (what `skip_special_tokens` leaves out of the text)."""
        return token_id in self._special_token_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token adds to a text after other text, also when they are only part of
        a character (a byte-level BPE piece of an emoji, a SentencePiece <0xNN> byte) or begin with a
        space that decoding drops at the start of a text (SentencePiece's "▁word", a WordPiece word;
        "##piece" adds none): joined, the tokens' bytes are the text's. Special tokens give their text."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_token_ids:
            return self.backend.decode([token_id], skip_special_tokens=False).encode()
        if self._is_byte_level and all(c in _BYTE_OF_CHAR for c in token):
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        if match := _BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        return self._text_after_other_text(token_id).encode()

    def _text_after_other_text(self, token_id: int) -> str:
        """The token decoded after an ordinary token, less that token's text."""
        if self._anchor_id is not None:
            text = self.backend.decode([self._anchor_id, token_id], skip_special_tokens=False)
            if text.startswith(self._anchor_text):
                return text[len(self._anchor_text):]
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **variables: Any) -> str:
        """The template's text; `variables` (e.g. enable_thinking) go to the template beside the special tokens.
        `continue_final_message`: the text ends with the last message's content, left open (as transformers)."""
        chat = self._tool_use_template if variables.get("tools") and self._tool_use_template else self._template
        if chat is None:
            raise ValueError("the model has no chat template (tokenizer_config.json chat_template); use completions")
        messages = [_with_content(m, chat.takes_content_lists) for m in messages]
        text = chat.template.render(**{**self.special_tokens, "tools": None, "documents": None, **variables,
                                       "messages": messages, "add_generation_prompt": add_generation_prompt})
        return _open_final_message(text, messages[-1].get("content")) if continue_final_message else text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **variables: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                    **variables), add_special_tokens=False)


def _mid_text_anchor(backend: tokenizers.Tokenizer, added_token_ids: frozenset[int]) -> int | None:
    """An ordinary one-letter token to decode other tokens after (see token_bytes), if the vocabulary has one."""
    for piece in ("a", "e", "t", "x", "▁a", "Ġa"):
        token_id = backend.token_to_id(piece)
        if token_id is not None and token_id not in added_token_ids and backend.decode([token_id]).strip():
            return token_id
    ordinary = (token_id for token_id in sorted(backend.get_vocab().values()) if token_id not in added_token_ids)
    return next((token_id for token_id in ordinary if backend.decode([token_id]).isalnum()), None)


def _with_content(message: Mapping[str, Any], takes_lists: bool) -> Mapping[str, Any]:
    """The message as its template reads it: a content list of text parts stays a list for a template that
    loops over content (Gemma 3's, Llama 4's: as transformers, and vLLM's "openai" content format, pass
    it), else its texts joined with newlines (vLLM's "string" format)."""
    content = message.get("content")
    if takes_lists or not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


def _loops_over_content(source: str) -> bool:
    """The template has a `for` over a message's content (`message['content']`, `message.content`, or a
    variable set to one), as vLLM detects the "openai" content format."""
    tree = _compile_env().parse(source)
    content_names = {node.target.name for node in tree.find_all(nodes.Assign)
                     if isinstance(node.target, nodes.Name) and _is_content(node.node)}
    return any(_is_content(loop.iter) or (isinstance(loop.iter, nodes.Name) and loop.iter.name in content_names)
               for loop in tree.find_all(nodes.For))


def _is_content(node: nodes.Node) -> bool:
    while isinstance(node, nodes.Filter) and node.node is not None:  # content | selectattr(...)
        node = node.node
    return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content") \
        or (isinstance(node, nodes.Getattr) and node.attr == "content")


def _open_final_message(text: str, final: Any) -> str:
    """`text` cut right after the final message's content (transformers' continue_final_message): a
    template that trimmed the content's trailing whitespace is cut after the trimmed content; of a content
    list, after its last text part (as transformers)."""
    if isinstance(final, list) and final:
        final = final[-1]["text"]
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise ValueError("continue_final_message: the final message's content must be non-empty text that the "
                         "chat template keeps")
    start = text.rindex(final.strip())
    kept = final.lstrip() if text[start:start + len(final.lstrip())] == final.lstrip() else final.strip()
    return text[:start + len(kept)]


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas as they arrive.

    Decodes a short window of ids (from the last emitted boundary, `prefix_offset`)
    and emits the text after what that window decoded to before (`read_offset`).
    While the decoded text ends with U+FFFD, a UTF-8 character is still split
    across tokens: the U+FFFD run at the end is held back (the window's text before it
    goes out: a token may end one character and start the next, and a run of such tokens
    would otherwise hold back everything, stop strings in it unseen, until the end);
    `flush` emits what is held at the end.
    With byte fallback, a run of <0xNN> tokens is held back until a token ends it: the
    decoder turns a whole invalid run into U+FFFD, bytes already valid on their own included.
    The deltas joined equal `decode(context_ids + ids)` minus `decode(context_ids)`.
    """

    def __init__(
        self, tokenizer: Tokenizer, context_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(context_ids)  # context (e.g. the prompt's tail) then every fed id
        self._prefix_offset = 0  # the window to decode starts here
        self._read_offset = len(self._ids)  # text of ids before this has been emitted
        self._num_early_chars = 0  # of the text after read_offset's, characters emitted before a U+FFFD

    def feed(self, token_ids: Iterable[int]) -> str:
        """The new text after adding these ids; "" while a character is incomplete."""
        self._ids.extend(token_ids)
        return self._emit(is_final=False)

    def flush(self) -> str:
        """Whatever is still held back, e.g. a trailing incomplete character as U+FFFD."""
        return self._emit(is_final=True)

    def held_back(self) -> str:
        """What `flush` would emit now, without emitting it: the deltas so far and this make the text of
        every id fed so far (the frontend places tool-call markers by it)."""
        if self._read_offset == len(self._ids):
            return ""  # all emitted: the window decodes to nothing more
        new_text, num_prefix_chars = self._window()
        return new_text[num_prefix_chars + self._num_early_chars:]

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special_tokens)

    def _ends_in_raw_byte(self) -> bool:
        """The last token the text is decoded from is a raw byte: a skipped special token after it leaves its
        run open (the decoder joins the bytes on both sides of it)."""
        for token_id in reversed(self._ids):
            if not (self._skip_special_tokens and self._tokenizer.is_special(token_id)):
                return self._tokenizer.is_raw_byte(token_id)
        return False

    def _window(self) -> tuple[str, int]:
        """The text of the ids from prefix_offset on, and how much of it the ids before read_offset make."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._decode(self._prefix_offset, len(self._ids)), len(prefix_text)

    def _emit(self, is_final: bool) -> str:
        if not is_final and self._ends_in_raw_byte():
            return ""
        new_text, num_prefix_chars = self._window()
        start = num_prefix_chars + self._num_early_chars
        if len(new_text) <= start:
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and not is_final:
            whole = new_text.rstrip(REPLACEMENT_CHAR)  # what comes before the split character is final
            self._num_early_chars = max(len(whole) - num_prefix_chars, self._num_early_chars)
            return whole[start:]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._num_early_chars = 0
        return new_text[start:]


def _raw_byte_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of the <0xNN> tokens (raw bytes where the decoder falls back to bytes)."""
    return frozenset(i for token, i in backend.get_vocab().items() if _BYTE_FALLBACK.fullmatch(token))


def _decoder_types(backend: tokenizers.Tokenizer) -> set[str]:
    """The decoder's type, or every type in a Sequence decoder."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return {d.get("type") for d in decoder.get("decoders", [decoder])}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token(value: str | dict[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _chat_templates(model_dir: Path, config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The default template and a named "tool_use" one, which transformers takes when tools are
    passed (Hermes 2 Pro and 3 ship both): from chat_template.jinja and
    additional_chat_templates/tool_use.jinja (transformers >= 4.43 writes them), or from
    tokenizer_config.json (a list of named templates, or one)."""
    path, tool_use_path = model_dir / "chat_template.jinja", model_dir / "additional_chat_templates" / "tool_use.jinja"
    if path.is_file():
        return path.read_text(), tool_use_path.read_text() if tool_use_path.is_file() else None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default"), named.get("tool_use")
    return template, None


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template rejected the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body. Templates written for training mark the
    assistant's text with it (transformers' AssistantTracker; TRL's assistant-only loss)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _compile_env() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols])


@dataclass(frozen=True, slots=True)
class _ChatTemplate:
    template: jinja2.Template
    takes_content_lists: bool  # it loops over a message's content: content lists reach it as the request sent them


def _chat_template(source: str) -> _ChatTemplate:
    return _ChatTemplate(_compile(source), _loops_over_content(source))


def _compile(template: str) -> jinja2.Template:
    env = _compile_env()
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)
