"""The model's recommended sampling settings as request defaults, as vLLM applies them.

`--generation-config auto` (the default) reads the `--model` folder's generation_config.json,
a folder path reads that folder's, `vllm` reads none (OpenAI's defaults); the JSON object of
`--override-generation-config` then sets or replaces fields (null removes one). Of the file,
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` are
read (vLLM's list; `do_sample` is not, as vLLM does not read it). A request that leaves a
field out or sends null gets the default; a value it sends wins. `max_new_tokens` is chat's
default max_tokens (completions keep OpenAI's 16, as in vLLM).

Each value is checked at startup by the reader a request's field goes through
(sampling_fields.py), so a default never makes a request fail; a bad one stops the frontend
with a message naming the file (or the flag) and the field.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from services.frontend import sampling_fields as fields
from services.frontend.request_error import RequestError

GENERATION_CONFIG_FILE = "generation_config.json"
AUTO = "auto"  # --generation-config: the --model folder's file
VLLM = "vllm"  # --generation-config: no file (vLLM's name for its neutral defaults)
OVERRIDE_FLAG = "--override-generation-config"

# generation_config.json field -> its reader (the request field's own); max_new_tokens is max_tokens
_READERS: dict[str, Callable[[Mapping[str, Any]], float | int | None]] = {
    "temperature": fields.temperature,
    "top_p": fields.top_p,
    "top_k": fields.top_k,
    "min_p": fields.min_p,
    "repetition_penalty": fields.repetition_penalty,
    "max_new_tokens": lambda body: fields.opt_int(body, "max_new_tokens", low=1, high=fields.INT32_MAX),
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request gets for each field it leaves out; None: OpenAI's default (openai_protocol)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 = off (the file's -1 or 0)
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # max_new_tokens: chat's default, at most what the context leaves

    def filled(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """`body` with each sampling default where the body leaves its field out or null."""
        missing = {name: value for name, value in self.request_fields().items() if body.get(name) is None}
        return {**body, **missing} if missing else body

    def request_fields(self) -> dict[str, float | int]:
        """The sampling fields set (max_tokens is not one: prompt_checks weighs it against the context)."""
        return {name: value for name, value in self.as_fields().items() if name != "max_tokens"}

    def as_fields(self) -> dict[str, float | int]:
        return {name: value for name, value in asdict(self).items() if value is not None}


OPENAI_DEFAULTS = SamplingDefaults()  # none: every field left out gets OpenAI's default (--generation-config vllm)


def load_sampling_defaults(model_dir: pathlib.Path, generation_config: str, override: str) -> SamplingDefaults:
    """The defaults `--generation-config` and `--override-generation-config` give; ValueError naming
    the file or flag and the field for anything a request could not send."""
    path = generation_config_path(model_dir, generation_config)
    values = checked_fields(read_generation_config(path), str(path)) if path is not None else {}
    for name, value in override_values(override).items():  # checked when the config was parsed
        if value is None:
            values.pop(name, None)
        else:
            values[name] = value
    return SamplingDefaults(**{("max_tokens" if name == "max_new_tokens" else name): value
                               for name, value in values.items()})


def generation_config_path(model_dir: pathlib.Path, generation_config: str) -> pathlib.Path | None:
    """The file to read: None for `vllm`, or for `auto` when the model folder has none."""
    if generation_config == VLLM:
        return None
    if generation_config == AUTO:
        path = model_dir / GENERATION_CONFIG_FILE
        return path if path.exists() else None
    path = pathlib.Path(generation_config) / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"--generation-config {generation_config}: no {GENERATION_CONFIG_FILE} in that folder; "
                         f"give a folder holding one, or {AUTO} (the --model folder's) or {VLLM} (none)")
    return path


def read_generation_config(path: pathlib.Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}; fix it, or start with --generation-config {VLLM}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(values).__name__}; fix it, or start with "
                         f"--generation-config {VLLM}")
    return values


def override_values(text: str) -> dict[str, Any]:
    """`--override-generation-config`: a JSON object of the fields above, each checked; null removes
    one. Unknown fields are refused (vLLM ignores them): a misspelt one would change nothing."""
    if not text.strip():
        return {}
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{OVERRIDE_FLAG}: not valid JSON ({exc}); give an object such as "
                         "'{\"temperature\": 0.5}'") from None
    if not isinstance(values, dict):
        raise ValueError(f"{OVERRIDE_FLAG}: expected a JSON object such as '{{\"temperature\": 0.5}}', got {text!r}")
    unknown = sorted(set(values) - set(_READERS))
    if unknown:
        raise ValueError(f"{OVERRIDE_FLAG}: unknown field {unknown[0]!r}; it takes {', '.join(_READERS)}")
    checked = checked_fields(values, OVERRIDE_FLAG)
    return {name: checked.get(name) for name in values}


def checked_fields(values: Mapping[str, Any], source: str) -> dict[str, float | int]:
    """Each of the fields that `values` sets (not null), read as a request's field is; fields
    other than these (eos_token_id, do_sample, ...) are left out."""
    checked: dict[str, float | int] = {}
    for name, reader in _READERS.items():
        if values.get(name) is None:
            continue
        try:
            checked[name] = reader({name: values[name]})
        except RequestError as exc:
            hint = f"; fix it, or start with --generation-config {VLLM}" if source != OVERRIDE_FLAG else ""
            raise ValueError(f"{source}: {exc.message}{hint}") from None
    return checked
