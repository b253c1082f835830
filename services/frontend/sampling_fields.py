"""The sampling fields of an OpenAI (or vLLM) request body, each read and checked on its own:
a `RequestError` (HTTP 400) naming the field for anything else, as openai_protocol.py promises.
Generic readers (`opt_bool`, `opt_int`, `opt_float`) check a field's JSON type and range; `sampling`
reads them all into the request's `Sampling`."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from services.common.prefix_hash import MAX_CACHE_SALT_CHARS
from services.frontend.generation import Sampling
from services.frontend.request_error import RequestError
from services.frontend.request_error import json_type as _json_type

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
UINT64 = 1 << 64
INT32_MAX = (1 << 31) - 1
_TOKEN_ID_KEY = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() also takes "¹" and "٣"
_MAX_TOKEN_ID_DIGITS = 10  # a longer key is no int32 (and int() refuses 4300+ digits with a ValueError)
# Fractions travel as float32, where a positive value below ~1e-45 becomes 0, which the wire reads
# as "unset" (top_p 1, repetition_penalty off). Smaller ones are raised to this; they mean the same.
_MIN_WIRE_FRACTION = 1e-30


def sampling(body: Mapping[str, Any], output_tokens: int | None, num_top_logprobs: int | None,
             stream: bool) -> Sampling:
    """The body's sampling fields, each checked; `output_tokens`: max_tokens or its default (0: an echo alone)."""
    return Sampling(
        temperature=temperature(body),
        top_p=top_p(body),
        top_k=top_k(body),
        seed=seed(body),
        max_tokens=None if output_tokens is None else max(1, output_tokens),
        stop=stop_strings(body),
        stop_token_ids=stop_token_ids(body),
        ignore_eos=opt_bool(body, "ignore_eos") or False,
        num_logprobs=0 if num_top_logprobs is None else max(1, num_top_logprobs),
        presence_penalty=opt_float(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=opt_float(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        logit_bias=logit_bias(body),
        repetition_penalty=repetition_penalty(body),
        min_p=min_p(body),
        cache_salt=cache_salt(body),
        min_tokens=opt_int(body, "min_tokens", low=0) or 0,
        num_prompt_logprobs=prompt_logprobs(body, stream),
    )


def stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        named = [("stop", stop)]
    elif isinstance(stop, list):
        named = [(f"stop[{i}]", s) for i, s in enumerate(stop)]
    else:
        raise RequestError(f"stop: expected a string or a list of strings, got {_json_type(stop)}", param="stop")
    for path, s in named:
        if not isinstance(s, str):
            raise RequestError(f"{path}: expected a string, got {_json_type(s)}", param=path)
    if len(named) > MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(named)}", param="stop")
    for path, s in named:
        if not s:
            raise RequestError(f"{path}: stop strings must not be empty", param=path)
    return tuple(s for _, s in named)


def truncate_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    value = opt_int(body, "truncate_prompt_tokens", low=-1, high=INT32_MAX)
    if value == 0:
        raise RequestError("truncate_prompt_tokens: must be >= 1 (keep that many of the prompt's last tokens) "
                           "or -1 (as many as the context holds)", param="truncate_prompt_tokens")
    return value


def stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    """vLLM's extension: token ids that end the output (the token is kept in token_ids, not in the text)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list):
        raise RequestError(f"stop_token_ids: expected a list of token ids (non-negative integers), got "
                           f"{_json_type(ids)}", param="stop_token_ids")
    bad = next((i for i, t in enumerate(ids) if not (is_int(t) and 0 <= t <= INT32_MAX)), None)
    if bad is not None:
        raise RequestError(f"stop_token_ids[{bad}]: token ids are non-negative integers below 2^31, got "
                           f"{json.dumps(ids[bad])[:20]}", param="stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(ids)}", param="stop_token_ids")
    return tuple(ids)


def temperature(body: Mapping[str, Any]) -> float:
    return opt_float(body, "temperature", 1.0, low=0.0, high=2.0)


def min_p(body: Mapping[str, Any]) -> float:
    """vLLM's extension: tokens below min_p x the most likely token's probability are left out."""
    return opt_float(body, "min_p", 0.0, low=0.0, high=1.0)


def top_p(body: Mapping[str, Any]) -> float:
    top_p = opt_float(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p: must be in (0, 1], got {top_p}", param="top_p")
    return max(top_p, _MIN_WIRE_FRACTION)  # any top_p this small keeps just the most likely token


def top_k(body: Mapping[str, Any]) -> int:
    top_k = opt_int(body, "top_k", low=-1, high=INT32_MAX)
    return 0 if top_k is None or top_k == -1 else top_k


def seed(body: Mapping[str, Any]) -> int | None:
    seed = opt_int(body, "seed", low=-(1 << 63), high=UINT64 - 1)
    return None if seed is None else seed % UINT64  # OpenAI seeds are int64; the engine takes uint64


def opt_bool(body: Mapping[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise RequestError(f"{param or name}: expected true or false, got {_json_type(value)}", param=param or name)


def opt_int(body: Mapping[str, Any], name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        raise RequestError(f"{name}: expected an integer, got {_json_type(value)}", param=name)
    check_range(name, value, low, high)
    return value


def prompt_logprobs(body: Mapping[str, Any], stream: bool) -> int | None:
    """vLLM's prompt_logprobs: each prompt token's logprob and rank, plus the top k at its position."""
    prompt_logprobs = opt_int(body, "prompt_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if prompt_logprobs is not None and stream:
        raise RequestError("prompt_logprobs: only without stream (a completions stream gives the prompt's logprobs "
                           "with echo and logprobs)", param="prompt_logprobs")
    return prompt_logprobs


def cache_salt(body: Mapping[str, Any]) -> str:
    """vLLM's extension: requests share cached prefix blocks only with requests of the same salt."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise RequestError(f"cache_salt: expected a string of 1 to {MAX_CACHE_SALT_CHARS} characters, got "
                           f"{_json_type(salt) if not isinstance(salt, str) else f'{len(salt)} characters'}",
                           param="cache_salt")
    return salt


def repetition_penalty(body: Mapping[str, Any]) -> float:
    """vLLM's extension: > 1 discourages repeating any prompt or output token, 1 = off."""
    penalty = opt_float(body, "repetition_penalty", 1.0, high=2.0)
    if penalty <= 0.0:
        raise RequestError(f"repetition_penalty: must be in (0, 2] (1 = off), got {penalty}",
                           param="repetition_penalty")
    return max(penalty, _MIN_WIRE_FRACTION)


def logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: ids as decimal strings, each token once ("1" and "01" are one token: a 400,
    not the last one winning), biases numbers in [-100, 100] (null is refused, as vLLM does)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(f"logit_bias: expected an object of token id -> bias, got {_json_type(value)}",
                           param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}", param="logit_bias")
    biases: dict[int, float] = {}
    keys: dict[int, str] = {}  # the key each token id was given by
    for key, bias in value.items():
        token_id = _logit_bias_token_id(key)
        if token_id in keys:
            raise RequestError(f"logit_bias: keys {keys[token_id]!r} and {key!r} both name token {token_id}; give "
                               "each token once", param="logit_bias")
        path = f"logit_bias.{key}"
        if bias is None:
            raise RequestError(f"{path}: expected a number, got null; leave the token out for no bias", param=path)
        keys[token_id], biases[token_id] = key, opt_float({path: bias}, path, 0.0, low=-100.0, high=100.0)
    return tuple(sorted(biases.items()))


def _logit_bias_token_id(key: str) -> int:
    if len(key) > _MAX_TOKEN_ID_DIGITS or not _TOKEN_ID_KEY.fullmatch(key) or int(key) > INT32_MAX:
        raise RequestError(f"logit_bias: keys are token ids (non-negative integers), got {str(key)[:20]!r}",
                           param="logit_bias")
    return int(key)


def opt_float(body: Mapping[str, Any], name: str, default: float, low: float | None = None,
               high: float | None = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name}: expected a number, got {_json_type(value)}", param=name)
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise RequestError(f"{name}: the number is too large", param=name) from None
    if not math.isfinite(number):
        raise RequestError(f"{name}: expected a finite number, got {number}", param=name)
    check_range(name, number, low, high)
    return number


def check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low or high is not None and value > high:
        bounds = f"between {low} and {high}" if low is not None and high is not None else (
            f">= {low}" if low is not None else f"<= {high}")
        raise RequestError(f"{name}: must be {bounds}, got {value}", param=name)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
