"""`up --frontend-arg`: flags the launcher passes on to its frontend, checked before anything starts.

Each value is split as a shell splits words (`--frontend-arg='--api-key K1'`, or one word:
`--frontend-arg=--generation-config=vllm`); the words go after the launcher's own flags on the
frontend's command line. They are parsed here by the frontend's own parser, with the environment
the frontend will see, so a flag it does not take or a bad value is a usage error of `up` (exit 2)
naming it, not a frontend that dies after etcd, the manager and the instances have started. The
flags the launcher sets itself are refused, naming the launcher's flag that sets them.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from services.common.config import build_parser
from services.frontend.config import FrontendConfig, load_config

PROG = "python -m services.cluster up --frontend-arg"

# the frontend's fields the launcher sets, and the flag of `up` that sets each (None: the launcher alone)
LAUNCHER_SET = {"model": "--model", "host": "--http-host", "port": "--http-port", "cluster": "--cluster",
                "etcd_endpoints": None, "log_format": "--log-format", "tls_ca": "--tls-ca", "tls_cert": "--tls-cert",
                "tls_key": "--tls-key", "cluster_token": "--cluster-token-file",
                "cluster_token_file": "--cluster-token-file"}
_CHECK_ETCD = ("--etcd-endpoints", "127.0.0.1:2379")  # stands for the launcher's etcd while checking


def frontend_words(values: Sequence[str]) -> tuple[str, ...]:
    """The words of every --frontend-arg value, in order; ValueError for one a shell could not split."""
    words: list[str] = []
    for value in values:
        try:
            words += shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"--frontend-arg {value!r}: {exc}") from None
    return tuple(words)


def launcher_set_flag(words: Sequence[str]) -> str | None:
    """A usage error's message if `words` set a flag the launcher sets itself (abbreviated too); else None."""
    parsed, _ = build_parser(FrontendConfig, "frontend", prog=PROG).parse_known_args(list(words))
    for name, flag in LAUNCHER_SET.items():
        if getattr(parsed, name, None) is not None:
            instead = f"; use up's {flag}" if flag else ""
            return f"--frontend-arg: --{name.replace('_', '-')} is set by the launcher{instead}"
    return None


def check_frontend_words(words: Sequence[str]) -> None:
    """Parse `words` as the frontend will (its usage error, exit 2, prog PROG, for a bad one)."""
    load_config([*_CHECK_ETCD, *words], prog=PROG)
