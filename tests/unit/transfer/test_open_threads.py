"""A gloo open whose peer never joins (it died between the open and its OpenChannel, or a firewall
drops the connection) blocks a thread in the rank-0 rendezvous until the rendezvous timeout
(real gloo, measured: it waits for the peer's key in the store). Those threads came from the io
pool that transfers' sends and receives wait in, and each retry of a transfer to that peer left
one more behind: a few retries starved every transfer of the service (found by a review). Now
opens run on threads of their own, a peer has at most one such open at a time (a retry meanwhile
fails at once, retryably), and an open waits no longer than the transfer that wanted it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.common.errors import Unavailable
from services.transfer.app import build_node
from services.transfer.client import TransferClients
from services.transfer.config import TransferConfig
from services.transfer.domain import TransferBackend, TransferId
from services.transfer.threads import TransferThreads, run_in_thread

pytestmark = pytest.mark.timeout(60)
CHANNEL_TIMEOUT_S = 3.0


async def never_joins(store_address: str, rank: int, num_connections: int, channel_id: int) -> None:
    raise Unavailable("the transfer service at dead:1 did not answer: connection refused")


@pytest.fixture
def node_and_threads():
    config = TransferConfig(channel_timeout_s=CHANNEL_TIMEOUT_S, num_staging_slots=1, staging_buffers=2,
                            staging_kib=64, transfer_timeout_s=30.0)
    threads = TransferThreads.start(config.num_staging_slots * config.staging_buffers)
    server = SimpleNamespace(advertise_host="127.0.0.1", address="127.0.0.1:1")
    node = build_node(config, TransferId("A"), server, None, TransferClients(), threads)
    yield node, threads
    node.channels.close()
    threads.shutdown()


async def test_retried_opens_to_a_peer_that_never_joins_leave_the_io_threads_to_transfers(node_and_threads):
    node, threads = node_and_threads
    for _ in range(threads.io._max_workers):  # a migration retrying its transfer to the dead peer
        with pytest.raises(Unavailable):
            await node.channels.outgoing("dead:1", TransferBackend.GLOO, never_joins)
    await asyncio.sleep(0.2)  # the last open's rank-0 constructor is on its thread
    start = time.monotonic()
    await run_in_thread(threads.io, time.sleep, 0)  # a transfer's send to a live peer
    assert time.monotonic() - start < 1.0  # was: until the blocked opens gave up, CHANNEL_TIMEOUT_S


async def test_a_retry_while_the_last_open_to_that_peer_still_waits_fails_at_once(node_and_threads):
    node, _ = node_and_threads
    with pytest.raises(Unavailable):
        await node.channels.outgoing("dead:1", TransferBackend.GLOO, never_joins)
    start = time.monotonic()
    with pytest.raises(Unavailable, match="still waits for it to join"):
        await node.channels.outgoing("dead:1", TransferBackend.GLOO, never_joins)
    assert time.monotonic() - start < 0.5


async def test_an_open_waits_no_longer_than_the_transfer_that_wanted_it(node_and_threads):
    node, _ = node_and_threads
    with pytest.raises(Unavailable):
        await node.channels.outgoing("dead:1", TransferBackend.GLOO, never_joins, timeout_s=0.5)
    await asyncio.sleep(1.5)  # its rendezvous gave up after 0.5 s, not CHANNEL_TIMEOUT_S
    assert node.channels.num_opens_under_way == 0
    with pytest.raises(Unavailable, match="did not answer"):  # a retry opens afresh
        await node.channels.outgoing("dead:1", TransferBackend.GLOO, never_joins, timeout_s=0.5)


async def test_a_transfer_waiting_for_another_ones_open_to_that_peer_fails_at_its_own_deadline(node_and_threads):
    """The per-peer lock: a second transfer to a peer whose open hangs (the OpenChannel call does not
    answer) waited for that open to give up, whatever its own deadline said."""
    node, _ = node_and_threads

    async def hangs(store_address: str, rank: int, num_connections: int, channel_id: int) -> None:
        await asyncio.sleep(CHANNEL_TIMEOUT_S)  # the OpenChannel RPC's deadline
        raise Unavailable("the transfer service at slow:1 did not answer: deadline exceeded")
    first = asyncio.ensure_future(node.channels.outgoing("slow:1", TransferBackend.GLOO, hangs))
    await asyncio.sleep(0.2)  # it holds the peer's lock, in its open
    start = time.monotonic()
    with pytest.raises(Unavailable, match="retry"):
        await node.channels.outgoing("slow:1", TransferBackend.GLOO, hangs, timeout_s=0.5)
    assert 0.4 < time.monotonic() - start < 1.5  # was: until the first open gave up, CHANNEL_TIMEOUT_S
    assert node.channels.num_locks == 1  # the first's; the one that gave up left nothing behind
    with pytest.raises(Unavailable, match="did not answer"):
        await first
    assert node.channels.num_locks == 0


async def test_opens_past_the_rendezvous_threads_wait_for_one_and_give_up_at_their_deadline(node_and_threads):
    node, threads = node_and_threads
    for n in range(threads.rendezvous_threads):  # dead peers, each holding a rendezvous thread
        with pytest.raises(Unavailable):
            await node.channels.outgoing(f"dead:{n}", TransferBackend.GLOO, never_joins)
    start = time.monotonic()
    with pytest.raises(Unavailable, match="rendezvous threads"):
        await node.channels.outgoing("live:1", TransferBackend.GLOO, never_joins, timeout_s=0.5)
    assert 0.4 < time.monotonic() - start < 1.5


async def test_opens_in_both_directions_at_once_do_not_hold_each_others_joins_back():
    """An open holds its thread until the peer joins, and the join needs a thread on the peer: with one
    pool for both, opens each way at once could hold every thread and all wait for their timeout."""
    from concurrent.futures import ThreadPoolExecutor

    from services.transfer.channels import ChannelTable

    with ThreadPoolExecutor(2) as a_threads, ThreadPoolExecutor(2) as b_threads:  # each: one open, one join
        tables = {name: ChannelTable(name, "127.0.0.1", CHANNEL_TIMEOUT_S, threads, max_rendezvous=1)
                  for name, threads in (("A", a_threads), ("B", b_threads))}

        async def open_to(src: str, dst: str):
            async def open_remote(store_address: str, rank: int, num_connections: int, channel_id: int) -> None:
                await tables[dst].accept(src, TransferBackend.GLOO, store_address, rank, num_connections,
                                         channel_id=channel_id)
            return await tables[src].outgoing(f"{dst}:1", TransferBackend.GLOO, open_remote)
        try:
            start = time.monotonic()
            await asyncio.gather(open_to("A", "B"), open_to("B", "A"))
            assert time.monotonic() - start < CHANNEL_TIMEOUT_S / 2
        finally:
            for table in tables.values():
                table.close()


def test_an_nccl_channel_keeps_the_tables_timeout_for_its_operations_whatever_opened_it(node_and_threads):
    """nccl keeps the group's timeout as every operation's for the channel's life (review): a channel
    opened by a transfer with 0.5 s left must not cut later transfers at 0.5 s. gloo's bounds its connect."""
    node, _ = node_and_threads
    assert node.channels._group_timeout_s(TransferBackend.NCCL, 0.5) == CHANNEL_TIMEOUT_S
    assert node.channels._group_timeout_s(TransferBackend.GLOO, 0.5) == 0.5
