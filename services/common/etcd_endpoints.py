"""etcd endpoints as an operator writes them (`host:port`, the host a name or an IPv4 address) and as
etcd3aio dials them: it joins them into one gRPC `ipv4:` target, which takes IPv4 addresses only
(and `localhost`, which it rewrites), so a name such as compose's `etcd:2379` failed every call
with "the target uri is not valid" until the name is resolved here."""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence

from etcd3aio.errors import EtcdConnectionError


_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def host_problem(host: str) -> str | None:
    """Why `host` is neither an IP address nor a DNS name (labels of letters, digits, - and _
    between dots), or None if it is one."""
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        return None
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return "expected an IP address or a host name (letters, digits, - and _ between dots)"
    return None


def check_host_flags(config: object, names: Iterable[str]) -> None:
    """A usage error (ValueError naming the flag) for the first of `config`'s host fields that is
    set and is no host; an empty one means its default."""
    for name in names:
        value = getattr(config, name)
        if value and (problem := host_problem(value)) is not None:
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: {problem}")


# ferry's gRPC services run on IPv4 (README "IPv6"): etcd3aio dials an `ipv4:` target, and peers' addresses in etcd
# records and the gloo/nccl channels' rendezvous are IPv4 addresses or names. The frontend's HTTP port may be IPv6.
IPV6_UNSUPPORTED = ("IPv6 addresses are not supported for ferry's gRPC services and etcd (only the frontend's "
                    "HTTP --host may be one); use an IPv4 address such as 127.0.0.1, or a host name")


def check_grpc_host_flags(config: object, names: Iterable[str]) -> None:
    """A usage error (ValueError naming the flag) for an IPv6 address in a host field of a gRPC service's config.
    `--host ::` (every address, IPv4 too) is allowed: the service advertises 127.0.0.1 or --advertise-host."""
    for name in names:
        value = getattr(config, name)
        if _is_ipv6(value) and not (name == "host" and value == "::"):
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: {IPV6_UNSUPPORTED}")


def address_problem(endpoint: str) -> str | None:
    """Why `endpoint` (an etcd endpoint, a --manager-address, a --transfer-address) is not `host:port`
    with a port 1..65535, or None if it is."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or "/" in endpoint or any(c.isspace() for c in endpoint):
        return "expected host:port, e.g. 127.0.0.1:2379 (no scheme, no path)"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"the port must be 1..65535, got {port!r}"
    return host_problem(host) or (IPV6_UNSUPPORTED if _is_ipv6(host) else None)


def check_address_flag(flag: str, endpoints: Sequence[str]) -> None:
    """A usage error (ValueError naming `flag`) for the first address that is not `host:port`."""
    for endpoint in endpoints:
        if (problem := address_problem(endpoint)) is not None:
            raise ValueError(f"{flag} {endpoint!r}: {problem}")


async def resolve_endpoints(endpoints: Sequence[str]) -> list[str]:
    """Each `name:port` as the IPv4 `address:port`s the name has now (IPv4 addresses and
    `localhost` as given). A name that does not resolve raises EtcdConnectionError, one of
    ETCD_ERRORS, so startup waits for it as for an etcd that does not answer yet."""
    resolved: list[str] = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if host == "localhost" or _is_ipv4(host):
            resolved.append(endpoint)
            continue
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), family=socket.AF_INET,
                                                                 type=socket.SOCK_STREAM)
        except OSError as exc:
            raise EtcdConnectionError(f"cannot resolve etcd endpoint {endpoint} (--etcd-endpoints): {exc}") from exc
        resolved += sorted({f"{info[4][0]}:{port}" for info in infos})
    return resolved


def single_host_name(endpoints: Sequence[str]) -> str | None:
    """The one host name every endpoint names (what etcd's certificate is checked against), if any."""
    hosts = {endpoint.rpartition(":")[0] for endpoint in endpoints}
    if len(hosts) != 1:
        return None
    (host,) = hosts
    return None if _is_ipv4(host) or host == "localhost" else host


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True
