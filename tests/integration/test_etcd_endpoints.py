"""etcd endpoints named by host name, as compose writes them (`etcd:2379`): etcd3aio dials one gRPC
`ipv4:` target, which takes addresses only, so before, every call through such an endpoint failed
with "the target uri is not valid" and a compose stack's services never registered."""

from __future__ import annotations

import socket

import pytest

from services.common.errors import Unavailable
from services.common.etcd_client import connect_etcd
from services.common.registry import Registry

pytestmark = pytest.mark.timeout(60)


def loopback_host_name() -> str:
    """A name other than localhost for 127.0.0.1 (this host's own name, where /etc/hosts says so)."""
    name = socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, 0, family=socket.AF_INET)}
    except OSError:
        addresses = set()
    if addresses != {"127.0.0.1"}:
        pytest.skip(f"this host's name {name!r} does not resolve to 127.0.0.1 alone ({sorted(addresses)})")
    return name


async def test_an_endpoint_named_by_host_name_reaches_etcd(etcd, cluster):
    port = etcd.endpoint.rpartition(":")[2]
    client = await connect_etcd([f"{loopback_host_name()}:{port}"])
    try:
        await client.kv.put(f"/ferry/{cluster}/probe".encode(), b"1", timeout=5)
        assert (await client.kv.get(f"/ferry/{cluster}/probe".encode(), timeout=5)).kvs[0].value == b"1"
    finally:
        await client.close()


async def test_a_name_that_does_not_resolve_is_waited_for_like_an_etcd_that_does_not_answer(cluster):
    registry = Registry(["no-such-etcd.invalid:2379"], cluster)
    try:
        with pytest.raises(Unavailable, match="did not answer within --etcd-wait-s 0.5.*cannot resolve"):
            await registry.wait_until_reachable(0.5)
    finally:
        await registry.close()
