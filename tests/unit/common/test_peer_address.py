"""One key per peer address, however it is spelled (services/common/peer_address.py)."""

from __future__ import annotations

import pytest

from services.common.peer_address import host_port, peer_key

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("spelled, key", [
    ("127.0.0.1:7001", "127.0.0.1:7001"), ("localhost:7001", "127.0.0.1:7001"), ("LOCALHOST.:007001", "127.0.0.1:7001"),
    ("[::1]:7001", "[::1]:7001"), ("::1:7001", "[::1]:7001"), ("[0:0:0:0:0:0:0:1]:7001", "[::1]:7001"),
    ("[::ffff:10.0.0.5]:7001", "10.0.0.5:7001"), ("Transfer-1.Example.com:7001", "transfer-1.example.com:7001"),
    ("no-port", "no-port"), ("host:port", "host:port"),
])
def test_peer_key(spelled, key):
    assert peer_key(spelled) == key
    assert peer_key(key) == key  # the tables key what they hold again (drop_outgoing of a channel's peer)


@pytest.mark.parametrize("host, address", [("127.0.0.1", "127.0.0.1:7"), ("instance-0", "instance-0:7"),
                                           ("::1", "[::1]:7"), ("[::1]", "[::1]:7"), ("::", "[::]:7")])
def test_host_port(host, address):
    assert host_port(host, 7) == address
