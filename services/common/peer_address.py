"""One key per peer address, however it is spelled.

`ChannelPool` (instances, managers, frontends dialling each other) keys its channels by it, so
`localhost:P`, `127.0.0.1:P` and an etcd record's spelling share one channel.

A peer transfer service is named by address in two places: a transfer's destination (`dst_transfer_address`, from the
destination instance's reservation or an operator's call) and the peer's etcd record (what `PeerWatch`
closes by). Spellings of one address (`localhost:P` and `127.0.0.1:P`; `[::1]:P`, `::1:P` and
`[0:0::1]:P`; letter case, a trailing dot, a zero-padded port) gave two outgoing channels to one peer,
which keeps one incoming channel per sender, so each open replaced the other's there; and a record's
address closed only its own spelling's. The tables keyed by peer address (`ChannelTable`,
`TransferClients`) go by `peer_key`. A client still dials the address as given (a TLS certificate
may name only that spelling). Host names are not resolved: a name and its IP address are two keys.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAME = "localhost"  # keyed as 127.0.0.1, where ferry's services bind by default


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC, HTTP URLs and etcd records want it: an IPv6 literal in brackets (`[::1]:P`)."""
    host = host.removeprefix("[").removesuffix("]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_key(address: str) -> str:
    """`address` (`host:port`) in one spelling: IP addresses in their compressed form (IPv6 in brackets, an
    IPv4-mapped one as IPv4), names in lower case without a trailing dot, localhost as 127.0.0.1, the port
    without leading zeros. Anything else is returned as it is."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address
    host = host.removeprefix("[").removesuffix("]").lower().removesuffix(".")
    if host == LOOPBACK_NAME:
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{host}:{int(port)}"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is None:
            return f"[{ip.compressed}]:{int(port)}"
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port)}"
