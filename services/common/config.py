"""Typed service configuration: one frozen dataclass per service.

Each knob's name, default and help live once, on the dataclass field
(`knob(default, "help")`). From it we generate the CLI flag `--field-name` and the
environment variable `FERRY_<SERVICE>_<FIELD_NAME>`. An optional YAML file
(`--config FILE`) holds the same names. Precedence: CLI > env > file > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import functools
import json
import math
import os
import pathlib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import yaml

C = TypeVar("C")
_HELP = "help"
_REQUIRED = "required"


def knob(default: Any, help: str) -> Any:
    """A config field with its default and help text (shown by --help)."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={_HELP: help})
    return dataclasses.field(default=default, metadata={_HELP: help})


def knob_help(field: dataclasses.Field) -> str:
    """The help text a `knob` field was declared with."""
    return field.metadata.get(_HELP, "")


def check_positive(config: object, names: Iterable[str], flag_prefix: str = "--") -> None:
    """A ValueError naming the flag (`--field-name`) of the first of the fields `names` of `config`
    that is not > 0 (nan included)."""
    for name in names:
        if not (value := getattr(config, name)) > 0:
            raise ValueError(f"{flag_prefix}{_flag(name)} must be positive, got {value}")


def check_non_negative(config: object, names: Iterable[str], flag_prefix: str = "--") -> None:
    """As `check_positive`, for fields that must be >= 0."""
    for name in names:
        if not (value := getattr(config, name)) >= 0:
            raise ValueError(f"{flag_prefix}{_flag(name)} must be >= 0, got {value}")


def env_name(service: str, field_name: str) -> str:
    return f"FERRY_{service}_{field_name}".upper()


def parse_config(cls: type[C], service: str, argv: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, description: str | None = None, prog: str | None = None) -> C:
    """Build `cls` from CLI flags, FERRY_* environment variables and an optional YAML file."""
    env = os.environ if env is None else env
    parser = build_parser(cls, service, description, prog)
    args = parser.parse_args(argv)
    config_path = args.config or env.get(env_name(service, "config"))
    file_values, file_texts = _load_file(config_path, parser)
    _check_file_keys(cls, file_values, config_path, parser)
    _check_env_names(cls, service, env, parser)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = _field_type(cls, field)
        raw, source = getattr(args, field.name), f"--{_flag(field.name)}"
        if raw is None and env_name(service, field.name) in env:
            raw, source = env[env_name(service, field.name)], env_name(service, field.name)
        if raw is None and field.name in file_values:  # an explicit `null` in the file means None
            raw, source = _as_written(file_values[field.name], file_texts.get(field.name), kind), \
                f"{config_path}:{field.name}"
            if raw is None:
                values[field.name] = None
                continue
        if raw is None:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                parser.error(f"--{_flag(field.name)} is required (or set {env_name(service, field.name)})")
            continue
        try:
            values[field.name] = convert(raw, kind)
        except (TypeError, ValueError) as exc:
            parser.error(f"{source}: {exc}")
        if _is_port(field.name) and not 0 <= values[field.name] <= 65535:
            parser.error(f"{source}: a port is 0..65535 (0 = any free one, where the flag allows it), "
                         f"got {values[field.name]}")
    try:
        return cls(**values)
    except ValueError as exc:  # __post_init__ validation
        parser.error(str(exc))


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit 2: argparse printed the whole
    usage first (50 lines for an instance), which a crash-looping unit's journal repeated per restart
    above the one line that says what is wrong; `--help` still shows it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's help ends with its default, unless that is None
    (the help says what happens then) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default in (None, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser(cls: type, service: str, description: str | None = None,
                 prog: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog or f"python -m services.{service}", description=description or cls.__doc__,
        epilog=f"Every flag can also be set as FERRY_{service.upper()}_<FLAG> (e.g. "
               f"{env_name(service, 'port')}) or in the --config YAML file. CLI beats env beats file beats default.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file with any of the options below (field names as "
                        f"keys) [env {env_name(service, 'config')}]")
    for field in dataclasses.fields(cls):
        kind = _field_type(cls, field)
        help_text = f"{knob_help(field)} [env {env_name(service, field.name)}]"
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            help_text += f" (one of: {', '.join(str(m.value) for m in kind)})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        parser.add_argument(f"--{_flag(field.name)}", dest=field.name, default=None, help=help_text,
                            metavar=field.name.upper(), nargs="?" if kind is bool else None,
                            const="true" if kind is bool else None)
    _show_defaults(parser, cls)
    return parser


def convert(raw: Any, kind: Any) -> Any:
    """Turn a CLI/env/YAML value into the field's type, with a readable error."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "null")):
            return None
        return convert(raw, inner[0])
    if origin in (list, tuple):
        (inner,) = typing.get_args(kind)[:1]
        items = raw if isinstance(raw, (list, tuple)) else [s for s in str(raw).split(",") if s.strip()]
        return origin(convert(item.strip() if isinstance(item, str) else item, inner) for item in items)
    if isinstance(raw, (list, tuple)) or (isinstance(raw, Mapping) and kind is not str):
        what = "a mapping" if isinstance(raw, Mapping) else "a list"  # from a YAML file: str() or int() took it
        raise ValueError(f"expected {getattr(kind, '__name__', kind)}, got {what} {raw!r}")
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {raw!r}")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return _convert_enum(raw, kind)
    if kind is pathlib.Path:
        return pathlib.Path(raw)
    if isinstance(raw, bool):  # a YAML file's true/false/yes/no/on/off: int(True) is 1, str(False) 'False'
        raise ValueError(f"expected {kind.__name__}, got the boolean {raw!r} (YAML reads an unquoted "
                         "true/false/yes/no/on/off so: quote it)")
    if kind is float:
        return _finite_float(raw)
    if kind is str and isinstance(raw, Mapping):  # a YAML mapping for a JSON knob (--override-generation-config)
        return json.dumps(raw)
    if kind is int and isinstance(raw, float) and not raw.is_integer():  # int() would cut 8000.5 to 8000
        raise ValueError(f"expected int, got {raw!r}")
    if kind in (int, str):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"expected {kind.__name__}, got {raw!r}") from None
    raise TypeError(f"unsupported config type {kind!r}")


def _finite_float(raw: Any) -> float:
    """A number of seconds, MiB, a threshold: nan and inf are never one (nan passes every `< 0` check,
    and inf turns a deadline or a sleep into an OverflowError far from the flag)."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"expected float, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def _convert_enum(raw: Any, kind: type[enum.Enum]) -> enum.Enum:
    """By value, case-insensitively, or by member name (`fast`, `FAST`, `ROLE_BOTH`)."""
    if isinstance(raw, kind):
        return raw
    text = str(raw).strip().lower()
    for member in kind:
        if text in (str(member.value).lower(), member.name.lower()):
            return member
    raise ValueError(f"expected one of {', '.join(str(m.value) for m in kind)}, got {raw!r}")


def path_shown(path: str | os.PathLike) -> str:
    """`path` for an error message: a relative one says where it was looked for. Relative paths, in a --config
    file as on the command line, are taken from the working directory, not from the file's folder."""
    if pathlib.Path(path).is_absolute():
        return str(path)
    return f"{path} (relative to the working directory {os.getcwd()}, not to a --config file)"


def as_dict(config: Any) -> dict[str, Any]:
    """A loggable view of a config (enums as values, paths as strings, secrets hidden)."""
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if _is_secret(field.name, value):
            value = "***"
        elif isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, pathlib.Path):
            value = str(value)
        out[field.name] = value
    return out


_SECRET_WORDS = frozenset({"key", "token", "password", "secret"})


def _is_secret(name: str, value: Any) -> bool:
    """Text under a name with a secret word in it (api_key, admin_token); never a number such as
    max_num_batched_tokens or sim_prefill_ms_per_token."""
    return bool(value) and isinstance(value, (str, list, tuple)) and not _SECRET_WORDS.isdisjoint(name.split("_"))


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_type(cls: type, field: dataclasses.Field) -> Any:
    return _type_hints(cls)[field.name]


@functools.lru_cache(maxsize=64)
def _type_hints(cls: type) -> dict[str, Any]:
    """Evaluated once per class: once per field, a service's config took ~90 ms of CPU to parse (its string
    annotations compiled again for each of its ~80 fields), 10 s on a loaded test machine."""
    return typing.get_type_hints(cls)


def _show_defaults(parser: argparse.ArgumentParser, cls: type) -> None:
    """Each option's help ends with its default, unless the help says it already (`(default:
    --host)`, `(default: <host>-<port>)`: before, those read "... (default: )" as well); an empty
    one shows as `empty`, which the help of such a knob explains ("empty = ...")."""
    defaults = {f.name: _default(f) for f in dataclasses.fields(cls)}
    for action in parser._actions:
        if action.dest in defaults and action.help and "(default" not in action.help:
            shown = "empty" if defaults[action.dest] == "" else defaults[action.dest]
            action.help += f" (default: {shown})".replace("%", "%%")


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return _REQUIRED
    if isinstance(value, (list, tuple)):
        return ",".join(str(item.value if isinstance(item, enum.Enum) else item) for item in value)
    return value.value if isinstance(value, enum.Enum) else value


def _is_port(name: str) -> bool:
    return name == "port" or name.endswith("_port")


def _check_file_keys(cls: type, file_values: Mapping[str, Any], path: str | None,
                     parser: argparse.ArgumentParser) -> None:
    """A key the service does not know is a typo an operator would never see otherwise."""
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(file_values) - known)
    if unknown:
        parser.error(f"--config {path}: unknown option(s) {_hints(unknown, known)}; `--help` lists them "
                     "(file keys use _ for -)")


def _check_env_names(cls: type, service: str, env: Mapping[str, str], parser: argparse.ArgumentParser) -> None:
    """A FERRY_<SERVICE>_ variable that names no option is a typo as well: an env file's
    FERRY_INSTANCE_KV_CACHE_MB was ignored without a word, the default taken."""
    known = {env_name(service, field.name) for field in dataclasses.fields(cls)} | {env_name(service, "config")}
    unknown = sorted(name for name in env if name.startswith(env_name(service, "")) and name not in known)
    if unknown:
        parser.error(f"unknown environment variable(s) {_hints(unknown, known)}; `--help` lists them")


def _hints(unknown: Iterable[str], known: Iterable[str]) -> str:
    """The unknown names, each with the nearest known one where there is one."""
    close = {name: difflib.get_close_matches(name, list(known), n=1) for name in unknown}
    return ", ".join(f"{name} (did you mean {match[0]}?)" if match else name for name, match in close.items())


def _load_file(path: str | None, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's values as YAML types them, and as written (every scalar as its text: `0001`, not 1)."""
    if not path:  # none, or an env file's empty FERRY_<SERVICE>_CONFIG= (was read as the folder '.')
        return {}, {}
    try:
        text = pathlib.Path(path).read_text()
        data = yaml.safe_load(text) or {}
        written = yaml.load(text, Loader=yaml.BaseLoader) or {}  # BaseLoader: str, list, dict only
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of option names to values")
    return ({str(k).replace("-", "_"): v for k, v in data.items()},
            {str(k).replace("-", "_"): v for k, v in written.items()})


def _as_written(value: Any, text: Any, kind: Any) -> Any:
    """A text knob (str, a path, a list of them) takes the file's scalars as written: YAML reads `instance_id: 0001`
    as the number 1, `name: 1.10` as 1.1 and `cluster: off` as False before a type is known. Anything else (an
    explicit null, a mapping for a JSON knob, a number for a number knob) keeps the value YAML gave it."""
    is_list = typing.get_origin(kind) in (list, tuple)
    inner = typing.get_args(kind)[0] if is_list else _optional_inner(kind)
    if value is None or inner not in (str, pathlib.Path):
        return value
    if is_list and isinstance(value, list) and isinstance(text, list) and all(isinstance(t, str) for t in text):
        return text
    return text if isinstance(text, str) and not isinstance(value, (Mapping, list)) else value


def _optional_inner(kind: Any) -> Any:
    """`T` for `T | None`, else `kind`."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next((arg for arg in typing.get_args(kind) if arg is not type(None)), kind)
    return kind
