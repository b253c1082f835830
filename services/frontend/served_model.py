"""The model the frontend serves, as far as the frontend needs it: its name, its context
length (config.json), and its tokenizer (tokenizer.json + the chat template in
tokenizer_config.json) for prompts, chat templates and logprob token strings."""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import jinja2

from services.common.config import path_shown
from services.frontend.chat_messages import ChatTemplateOptions
from services.frontend.openai_protocol import Endpoint, ParsedRequest, Prompt, RequestError
from services.frontend.prompt_checks import check_in_vocabulary, check_prompt_token_ids
from services.frontend.sampling_defaults import SamplingDefaults
from services.frontend.structured_output import checked_grammar
from services.frontend.tokenize_protocol import TokenizeRequest
from services.frontend.tool_calls import (HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARKERS, ToolCallFormat,
                                          ToolCallParserSetting)
from services.frontend.tool_grammar import tool_call_grammar
from services.instance.engine.context_window import checked_max_model_len, context_limit  # no torch
from services.instance.engine.model_fingerprint import fingerprint_if_readable  # no torch
from services.instance.engine.tokenizer import Tokenizer  # tokenizers + jinja2, no torch


class TextTokenizer(Protocol):
    """What the frontend uses of `services.instance.engine.tokenizer.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **variables: Any) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def detokenizer_context(self, prompt_ids: Sequence[int]) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: list[int]
    echo_text: str = ""  # completions with echo: the prompt as the model saw it


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # what clients put in `model`
    max_model_len: int  # prompt + output, in tokens
    vocab_size: int
    tokenizer: TextTokenizer
    tool_call_format: ToolCallFormat | None = None  # how its answers call tools; None: not parsed
    tool_tag_token_ids: tuple[tuple[str, int], ...] = ()  # the format's tags its vocabulary holds as one token
    shown_marker_ids: tuple[tuple[int, str], ...] = ()  # mistral: special tokens shown to the tool-call parser
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # its generation config's (sampling_defaults.py)
    fingerprint: str = ""  # of the weights in its folder (model_fingerprint.py); "": the folder holds none

    @classmethod
    def load(cls, folder: pathlib.Path, name: str, max_model_len: int = 0,
             tool_call_parser: ToolCallParserSetting = ToolCallParserSetting.AUTO) -> ServedModel:
        """Read `folder`; `max_model_len` 0 means the longest the model serves (config.json's
        max_position_embeddings, or less for longrope RoPE: context_window.py); `tool_call_parser`
        auto reads the tool-call format from the chat template."""
        config_path = folder / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--model {path_shown(folder)}: cannot read {config_path}: {exc}") from exc
        context = checked_max_model_len(max_model_len, context_limit(config))
        tokenizer = Tokenizer.from_dir(folder)
        model = cls(name=name, max_model_len=context, vocab_size=int(config["vocab_size"]), tokenizer=tokenizer,
                    fingerprint=fingerprint_if_readable(folder))
        return model.with_tool_calls(tool_call_parser.format_for(tokenizer.tool_use_template or tokenizer.chat_template))

    def with_tool_calls(self, format_: ToolCallFormat | None) -> ServedModel:
        """Tool calls read in `format_`. Its tags that the vocabulary holds as one token are noted (forced
        calls' grammars take them by id), and those that are special tokens, which the answer's text
        leaves out (Mistral's [TOOL_CALLS], hermes tags some tokenizers mark special), are shown to the
        parser of a request that reads calls (`shown_marker_ids`)."""
        tags = (HERMES_OPEN, HERMES_CLOSE) if format_ is ToolCallFormat.HERMES else \
            MISTRAL_MARKERS if format_ is not None and format_.is_mistral else ()
        single = [(tag, ids[0]) for tag in tags if len(ids := self.tokenizer.encode(tag, add_special_tokens=False)) == 1]
        shown = [(token_id, tag) for tag, token_id in single if self.is_hidden(token_id)]
        return replace(self, tool_call_format=format_, tool_tag_token_ids=tuple(single), shown_marker_ids=tuple(shown))

    def prepared_prompts(self, parsed: ParsedRequest) -> list[PreparedPrompt]:
        """Each prompt's token ids (as given, or encoded), or the chat messages' through the template;
        with echo, also its text. Slow for a long prompt: call it off the event loop."""
        self._check_sampling_tokens(parsed)
        self._check_tool_calls(parsed)
        if parsed.endpoint is Endpoint.CHAT:
            token_ids = self._chat_token_ids(parsed.messages or (), parsed.chat_template)
            return [PreparedPrompt(self._checked(self._truncated(token_ids, parsed.truncate_prompt_tokens),
                                                 "messages"))]
        names = [f"prompt[{i}]" for i in range(len(parsed.prompts))] if parsed.is_batch else ["prompt"]
        return [self._prepared(prompt, name, parsed) for prompt, name in zip(parsed.prompts, names)]

    def _check_sampling_tokens(self, parsed: ParsedRequest) -> None:
        """Token ids in the sampling fields are checked here, before any dispatch (the engine checks
        them again): a 400 that costs no instance a call."""
        check_in_vocabulary(parsed.sampling.stop_token_ids, self.vocab_size, "stop_token_ids", first_index=0)
        for token_id, _ in parsed.sampling.logit_bias:
            check_in_vocabulary([token_id], self.vocab_size, f"logit_bias.{token_id}")

    def constrained(self, parsed: ParsedRequest) -> ParsedRequest:
        """The request with its grammar (`sampling.grammar`): its structured output, its forced tool
        calls in this model's format, or with tool_choice auto and a JSON constraint, either. The
        grammar is checked here (up to a few hundred ms for a big one): call it off the event loop."""
        if not parsed.needs_grammar:
            return parsed
        self._check_tool_calls(parsed)
        constraint, tools = parsed.constraint, parsed.tool_use
        if tools.parses_calls and self.tool_call_format is not None:  # forced, or auto with a JSON constraint
            grammar = tool_call_grammar(tools, self.tool_call_format, constraint, dict(self.tool_tag_token_ids))
        elif constraint is not None:
            grammar = checked_grammar(constraint.grammar, constraint.param)
        return replace(parsed, sampling=replace(parsed.sampling, grammar=grammar))

    def _check_tool_calls(self, parsed: ParsedRequest) -> None:
        if parsed.tool_use.parses_calls and self.tool_call_format is None:
            what = "calls cannot be forced nor read" if parsed.tool_use.is_forced else "calls cannot be read"
            raise RequestError(
                f"tools: {what} from this model's answers: its chat template shows no tool-call format ferry "
                "parses (ferry reads hermes <tool_call> JSON, llama3 JSON and mistral [TOOL_CALLS]); set "
                "tool_choice to \"none\" (the tools are shown, nothing is parsed), or start the frontend with "
                "--tool-call-parser", param="tools")

    def _prepared(self, prompt: Prompt, name: str, parsed: ParsedRequest) -> PreparedPrompt:
        all_ids = self._prompt_token_ids(prompt, parsed.add_special_tokens)
        token_ids = self._truncated(all_ids, parsed.truncate_prompt_tokens)
        is_ids = not isinstance(prompt, str)  # the request's own list: an error names the id (`prompt[5]`)
        check_prompt_token_ids(token_ids, self.vocab_size, name, len(all_ids) - len(token_ids) if is_ids else None)
        if not parsed.echo:
            return PreparedPrompt(token_ids)
        # the prompt as the model saw it: as given, or where truncate_prompt_tokens cut it, the kept tokens'
        # text, so the echo agrees with the echoed logprobs' tokens and offsets
        return PreparedPrompt(token_ids, self.prompt_text(token_ids if len(token_ids) < len(all_ids) else prompt))

    def _truncated(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last `keep` ids (-1: as many as the context holds)."""
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        return token_ids[-keep:]

    def prompt_text(self, prompt: Prompt) -> str:
        """A prompt as text (an echo): as given, or its token ids decoded, special tokens kept (as
        the echoed logprobs list them, and as a prompt given as text would show them)."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(list(prompt), skip_special_tokens=False)

    def _prompt_token_ids(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return list(prompt)

    def _checked(self, token_ids: list[int], name: str) -> list[int]:
        check_prompt_token_ids(token_ids, self.vocab_size, name)
        return token_ids

    def tokenize(self, request: TokenizeRequest) -> list[int]:
        """`/tokenize`: the prompt's ids (with or without special tokens), or the chat template's."""
        if request.messages is not None:
            return self._chat_token_ids(request.messages, request.chat_template)
        return self._prompt_token_ids(request.text or "", request.add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """`/detokenize`: the text of any ids in the vocabulary, special tokens included."""
        check_in_vocabulary(token_ids, self.vocab_size, "tokens", first_index=0)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def token_text(self, token_id: int) -> str:
        return _token_text(self.tokenizer, token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return _token_bytes_cached(id(self.tokenizer), self.tokenizer, token_id)

    def is_hidden(self, token_id: int) -> bool:
        """Left out of output text (a special token: skip_special_tokens)."""
        return _is_hidden_cached(id(self.tokenizer), self.tokenizer, token_id)

    def _chat_token_ids(self, messages: Sequence[dict[str, Any]], options: ChatTemplateOptions) -> list[int]:
        try:
            return list(self.tokenizer.encode_chat(list(messages), options.add_generation_prompt,
                                                   options.continue_final_message, **dict(options.kwargs)))
        except (ValueError, TypeError, jinja2.TemplateError) as exc:  # no template, its raise_exception, bad kwargs
            raise RequestError(f"messages: {exc}", param="messages") from None


@functools.lru_cache(maxsize=65536)
def _token_text_cached(tokenizer_id: int, tokenizer: TextTokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


@functools.lru_cache(maxsize=65536)
def _token_bytes_cached(tokenizer_id: int, tokenizer: TextTokenizer, token_id: int) -> bytes:
    return tokenizer.token_bytes(token_id)


@functools.lru_cache(maxsize=65536)
def _is_hidden_cached(tokenizer_id: int, tokenizer: TextTokenizer, token_id: int) -> bool:
    return tokenizer.decode([token_id]) == "" != tokenizer.decode([token_id], skip_special_tokens=False)


def _token_text(tokenizer: TextTokenizer, token_id: int) -> str:
    return _token_text_cached(id(tokenizer), tokenizer, token_id)
