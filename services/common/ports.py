"""Whether a TCP port can be bound here now, as a server would bind it (SO_REUSEADDR, no SO_REUSEPORT)."""

from __future__ import annotations

import socket


def bind_error(host: str, port: int) -> OSError | None:
    """The error binding host:port gives now (EADDRINUSE: another listener holds it), or None.
    `host` may be an address, "[::]"-style, or a name (its first address is tried)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return exc
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc
    return None
