"""What an instance or manager id may be: it names etcd keys (`instances/<id>`), log fields,
metric labels and shared-memory files, so one word of at most MAX_ID_CHARS safe characters."""

from __future__ import annotations

import re
import socket

from services.common.errors import InvalidArgument

MAX_ID_CHARS = 128
_ID_CHARS = "A-Za-z0-9._:@-"  # a regex character class's body
_ID = re.compile(f"[A-Za-z0-9][{_ID_CHARS}]*")


def id_problem(value: str) -> str | None:
    """Why `value` cannot be an id, or None if it can."""
    if len(value) > MAX_ID_CHARS:
        return f"longer than {MAX_ID_CHARS} characters ({len(value)})"
    if not _ID.fullmatch(value):
        return "not an id: letters, digits and . _ : @ - only, starting with a letter or digit"
    return None


def host_word(host: str | None = None, max_chars: int = 64) -> str:
    """This host's name (or `host`) as one id-safe word: other characters become '_'."""
    word = re.sub(f"[^{_ID_CHARS}]", "_", host if host is not None else socket.gethostname())
    return (word if word[:1].isalnum() else "h" + word)[:max_chars]


def default_id(port: int) -> str:
    """`<host>-<port>`: the id of an instance or manager started without one."""
    return f"{host_word()}-{port}"


def check_id_flag(flag: str, value: str) -> None:
    """A command line's id (empty: the default, made from the host): ValueError naming `flag`."""
    if value and (problem := id_problem(value)) is not None:
        raise ValueError(f"{flag} {value[:40]!r}: {problem}")


def check_cluster_flag(value: str) -> None:
    """--cluster names the etcd prefix /ferry/<cluster>/: one id-like word (before, an empty name
    gave /ferry//, and `a/b` nested one cluster's keys under another's)."""
    if not value:
        raise ValueError("--cluster is empty; name the cluster (etcd keys live under /ferry/<cluster>/), e.g. ferry")
    check_id_flag("--cluster", value)


def check_id(field: str, value: str) -> str:
    """`value` if it can be an id, else INVALID_ARGUMENT naming `field` (and the value, shortened)."""
    if (problem := id_problem(value)) is not None:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InvalidArgument(f"{field}: {shown!r} is {problem}")
    return value
