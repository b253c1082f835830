"""The channel table: this transfer service's point-to-point channels (pair_channel.py) by peer.

Each pair has a process group of its own, so membership changes never rebuild anything;
a broken channel is dropped and the next transfer to that peer opens a fresh one.

Rendezvous: the sender starts a TCPStore on a free port and, at the same time, builds its
rank-0 group (which blocks until the peer joins) and calls `open_remote` — an RPC
asking the peer to join as rank 1 (`accept`). All constructors run on rendezvous threads
(`TransferThreads.rendezvous`, not the io threads transfers wait in), at most
`max_rendezvous` opens and as many joins at once (separately: an open waits for its peer's
join): one past them waits for a thread until its timeout. An open, a wait for another
transfer's open to that peer included, takes at most `--channel-timeout-s`, or the transfer's
remaining time if shorter. A peer that never
joins (it died after the open began, or a firewall drops the connection) leaves the rank-0
constructor blocked until then, and nothing wakes it; so a retry to that peer meanwhile fails
at once (Unavailable) rather than block another thread: one such peer holds one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from concurrent.futures import Executor
from dataclasses import dataclass, field

import structlog
import torch
import torch.distributed as dist

from services.common.error_text import typed_error_text
from services.common.errors import Unavailable
from services.common.task_errors import read_error
from services.transfer.deadline import Deadline
from services.transfer.domain import IDLE_CLOSE_S, TransferBackend
from services.transfer.pair_channel import (PairChannel, check_backend_available, client_store, create_group,
                                            master_store, store_prefix)
from services.common.peer_address import peer_key
from services.transfer.threads import NUM_RENDEZVOUS_THREADS

log = structlog.get_logger(__name__)

# (store_address, rank, connections, channel_id) → the peer joined; its life (Incarnation; 0 or None: unknown)
OpenRemote = Callable[[str, int, int, int], Awaitable[int | None]]


class ChannelTable:
    """Channels by peer: outgoing ones keyed by the peer's address, incoming by its transfer id.

    A peer that restarts comes back under a new address or id (the default port is 0), and its old
    channels would hold their connections, threads and store for good. So a channel no transfer has
    taken for `idle_close_s` is dropped when the next channel opens, and an outgoing one is opened
    afresh rather than used after such a pause; incoming ones are dropped after twice that. So the
    sender, who drops first, never sends on a channel its peer has already dropped (a transfer
    takes both ends, so the receiver's idle time is never shorter). `idle_close_s` must be well above
    the longest transfer (the app passes at least 4 x --transfer-timeout-s).

    Each channel knows which life of its peer joined it (`PairChannel.peer_incarnation`, from OpenChannel), so the
    end of a peer's older life closes only that life's channels: a peer restarted on its own port answers before it
    registers, and the channels its new life opens meanwhile outlive the news of the old life's end."""

    def __init__(self, transfer_id: str, host: str, timeout_s: float, executor: Executor,
                 gloo_connections: int = 1, nccl_device: int = 0, idle_close_s: float = IDLE_CLOSE_S,
                 max_rendezvous: int = NUM_RENDEZVOUS_THREADS, incarnation: int = 0) -> None:
        """`executor`: the rendezvous threads (2 x `max_rendezvous`: opens and joins); `timeout_s`: the longest
        an open or join waits; `incarnation`: this process's life, told to every peer a channel opens with."""
        self._transfer_id = transfer_id
        self.incarnation = incarnation
        self._idle_close_s = idle_close_s
        self._host = host
        self._timeout_s = timeout_s
        self._executor = executor
        self._max_rendezvous = max_rendezvous
        # Opens (rank 0, waiting for a peer to join) and joins (rank 1) take separate threads: an open
        # waits for a join, so with shared threads opens in both directions could hold them all.
        self._open_slots = asyncio.Semaphore(max_rendezvous)
        self._join_slots = asyncio.Semaphore(max_rendezvous)
        self._num_rendezvous = 0  # rendezvous steps on threads now
        # Rank-0 constructors still blocked after their open failed (the peer never joined), by key.
        self._abandoned: dict[tuple[str, TransferBackend], asyncio.Future] = {}
        self._gloo_connections = gloo_connections
        self._nccl_device = nccl_device
        self._outgoing: dict[tuple[str, TransferBackend], PairChannel] = {}
        self._incoming: dict[tuple[str, TransferBackend], PairChannel] = {}
        # One lock per key while an `outgoing` call holds or waits for it; the last one out drops it, so a
        # peer that went away (a failed open, a channel dropped after a failed transfer) leaves none behind.
        self._locks: dict[tuple[str, TransferBackend], _KeyLock] = {}
        # Channels of gone peers closing on threads (`close_outgoing`, `close_incoming`).
        self._closing: set[asyncio.Future] = set()

    async def outgoing(self, peer_address: str, backend: TransferBackend, open_remote: OpenRemote,
                       timeout_s: float | None = None) -> PairChannel:
        """The channel to `peer_address`, opened on first use (this side is rank 0). The call, a wait for
        another call's open to that peer included, takes at most `timeout_s` (the transfer's remaining
        time) or the table's timeout, if shorter; then Unavailable. Spellings of one address share a channel
        (`peer_key`); `open_remote` dials the address as the caller spells it."""
        check_backend_available(backend, self._nccl_device)
        peer_address = peer_key(peer_address)
        key = (peer_address, backend)
        deadline = Deadline.after(self._open_timeout_s(timeout_s))
        async with self._locked(key, deadline):
            if key in self._outgoing and self._is_idle(self._outgoing[key], self._idle_close_s):
                self.drop_outgoing(peer_address, backend)  # its peer may have dropped its end by now
            if key not in self._outgoing:
                self._check_not_abandoned(key)
                self._drop_idle()
                self._outgoing[key] = await self._open(peer_address, backend, open_remote, deadline.remaining_s())
            channel = self._outgoing[key]
            channel.last_used = time.monotonic()
            return channel

    async def accept(self, peer_id: str, backend: TransferBackend, store_address: str, rank: int,
                     num_connections: int, timeout_s: float | None = None, channel_id: int = 0,
                     peer_incarnation: int = 0) -> None:
        """Join the group the peer opened (replacing an older channel from it, which closes once unused),
        within `timeout_s` (the OpenChannel call's) or the table's timeout, if shorter. `channel_id`: the
        name the peer gave the channel, `peer_incarnation` its life (0: none, an older peer)."""
        check_backend_available(backend, self._nccl_device)
        timeout_s = self._open_timeout_s(timeout_s)
        host, _, port = store_address.rpartition(":")
        store = await self._rendezvous(self._join_slots, timeout_s, client_store, host, int(port), timeout_s)
        prefix = dist.PrefixStore(store_prefix(peer_id, self._transfer_id, backend), store)
        group = await self._rendezvous(self._join_slots, timeout_s, create_group, backend, prefix, rank, self._host,
                                       self._group_timeout_s(backend, timeout_s), num_connections)
        # The old channel from that peer closes once no receive uses it: the peer opens afresh also when it
        # retired its end (etcd said we left) while a transfer still ran on it, which completes.
        if (old := self._incoming.pop((peer_id, backend), None)) is not None:
            old.retire(self._close_in_background)
        self._drop_idle()
        self._incoming[(peer_id, backend)] = PairChannel(peer_id, backend, rank, group, store, self._device_for(backend),
                                                         channel_id=channel_id, peer_incarnation=peer_incarnation)
        log.info("channel_accepted", peer_transfer_id=peer_id, backend=backend.value, store_address=store_address,
                 channel_id=channel_id, peer_incarnation=peer_incarnation)

    @contextlib.asynccontextmanager
    async def _locked(self, key: tuple[str, TransferBackend], deadline: Deadline) -> AsyncIterator[None]:
        """Hold `key`'s lock, waiting for it until `deadline` at most (then Unavailable); it is dropped
        once no caller holds or waits for it."""
        entry = self._locks.setdefault(key, _KeyLock())
        entry.num_users += 1
        try:
            try:
                async with asyncio.timeout(deadline.remaining_s()):
                    await entry.lock.acquire()
            except TimeoutError:
                peer, backend = key
                raise Unavailable(f"another transfer's open of the {backend.value} channel to {peer} was still "
                                  "under way at this one's deadline; retry") from None
            try:
                yield
            finally:
                entry.lock.release()
        finally:
            entry.num_users -= 1
            if not entry.num_users:
                del self._locks[key]

    def incoming(self, peer_id: str, backend: TransferBackend, channel_id: int = 0) -> PairChannel:
        """The channel from `peer_id`; `channel_id` (0: any) names the one the sender sends on."""
        channel = self._incoming.get((peer_id, backend))
        if channel is None:
            # Dropped (a transfer on it failed here, or it idled out) or never opened (this service restarted
            # under the same id): the sender's end is stale, and a retry opens afresh. Not a precondition:
            # a migration takes those for a refusal and does not retry.
            raise Unavailable(f"no {backend.value} channel from transfer service {peer_id!r} (this end was dropped "
                              "after a failed transfer, or never opened); retry, which opens a fresh one")
        if channel_id and channel.channel_id != channel_id:
            # The sender opened a fresh channel since (its end of this one was dropped), and that OpenChannel
            # overtook this call: receives posted on the fresh one would wait for messages that never come.
            raise Unavailable(f"the {backend.value} channel from transfer service {peer_id!r} that these blocks were "
                              "sent on was replaced by a newer one from it; retry, on the channel it has now")
        channel.last_used = time.monotonic()
        return channel

    def drop_outgoing(self, peer_address: str, backend: TransferBackend, only: PairChannel | None = None) -> None:
        """`only`: close that channel, and take it out of the table if it is still there (not one opened since)."""
        peer_address = peer_key(peer_address)
        if only is not None and self._outgoing.get((peer_address, backend)) is not only:
            only.close()  # already out of the table (dropped, or retired: its peer is gone)
            return
        if (channel := self._outgoing.pop((peer_address, backend), None)) is not None:
            channel.close()
            log.info("channel_dropped", peer=peer_address, backend=backend.value, direction="outgoing")

    def drop_incoming(self, peer_id: str, backend: TransferBackend, only: PairChannel | None = None) -> None:
        """`only`: close that channel, and take it out of the table if it is still there (not one the peer
        opened since)."""
        if only is not None and self._incoming.get((peer_id, backend)) is not only:
            only.close()  # already out of the table (replaced, dropped, or retired: its peer is gone)
            return
        if (channel := self._incoming.pop((peer_id, backend), None)) is not None:
            channel.close()
            log.info("channel_dropped", peer=peer_id, backend=backend.value, direction="incoming")

    def close_outgoing(self, peer_address: str, incarnation: int = 0) -> int:
        """A life of a peer transfer service is gone (`PeerWatch`): take its channels to `peer_address` out of the
        table (under any spelling) and close each now, or once the transfers on it end (`PairChannel.retire`).
        `incarnation`: that life (0: unknown, every channel there); a channel another life joined stays. Returns
        how many."""
        return self._retire(self._outgoing, peer_key(peer_address), incarnation, "outgoing")

    def close_incoming(self, peer_id: str, incarnation: int = 0) -> int:
        """The same for the channels from transfer service `peer_id`."""
        return self._retire(self._incoming, peer_id, incarnation, "incoming")

    def _retire(self, channels: dict[tuple[str, TransferBackend], PairChannel], peer: str, incarnation: int,
                direction: str) -> int:
        gone = [(key, channels.pop(key)) for key, channel in list(channels.items())
                if key[0] == peer and _may_be_of(channel, incarnation)]
        for (_, backend), channel in gone:
            channel.retire(self._close_in_background)
            log.info("channel_dropped", peer=peer, backend=backend.value, direction=direction, why="peer_gone",
                     num_transfers=channel.num_transfers)
        return len(gone)

    def _close_in_background(self, channel: PairChannel) -> None:
        """Close on one of the loop's default threads: destroying a gloo group takes 20-50 ms (measured: the
        first end of a pair to go waits for its connections), too long for the event loop when many go at once."""
        future = asyncio.get_running_loop().run_in_executor(None, channel.close)
        self._closing.add(future)
        future.add_done_callback(self._closed)

    def _closed(self, future: asyncio.Future) -> None:
        self._closing.discard(future)
        if (error := read_error(future)) is not None:
            log.warning("close_failed", what="channel", error=typed_error_text(error))

    async def wait_closed(self) -> None:
        """Wait for the channels of gone peers that are closing now."""
        await asyncio.gather(*self._closing)

    @property
    def num_channels(self) -> int:
        return len(self._outgoing) + len(self._incoming)

    @property
    def num_opens_under_way(self) -> int:
        """Rendezvous steps on threads now (a failed open's rank-0 constructor waiting for its timeout included)."""
        return self._num_rendezvous

    @property
    def num_locks(self) -> int:
        """Per-peer locks held or waited on now (an outgoing open in progress)."""
        return len(self._locks)

    def _drop_idle(self) -> None:
        for (peer, backend), channel in list(self._outgoing.items()):
            if self._is_idle(channel, self._idle_close_s) and (peer, backend) not in self._locks:
                self.drop_outgoing(peer, backend)
        for (peer, backend), channel in list(self._incoming.items()):
            if self._is_idle(channel, 2 * self._idle_close_s):
                self.drop_incoming(peer, backend)

    @staticmethod
    def _is_idle(channel: PairChannel, idle_s: float) -> bool:
        return time.monotonic() - channel.last_used >= idle_s

    def close(self) -> None:
        for peer, backend in list(self._outgoing):
            self.drop_outgoing(peer, backend)
        for peer, backend in list(self._incoming):
            self.drop_incoming(peer, backend)

    def _device_for(self, backend: TransferBackend) -> torch.device:
        return torch.device("cuda", self._nccl_device) if backend is TransferBackend.NCCL else torch.device("cpu")

    async def _open(self, peer_address: str, backend: TransferBackend, open_remote: OpenRemote,
                    timeout_s: float) -> PairChannel:
        store = await self._rendezvous(self._open_slots, timeout_s, master_store, self._host, timeout_s)
        prefix = dist.PrefixStore(store_prefix(self._transfer_id, "", backend), store)
        channel_id = secrets.randbits(63) + 1  # random: no two opens share one, across restarts of either side too
        # On its thread before the peer is asked to join: a join never waits for an open still waiting for a thread.
        group_future = await self._start_rendezvous(self._open_slots, timeout_s, create_group, backend, prefix, 0,
                                                    self._host, self._group_timeout_s(backend, timeout_s),
                                                    self._gloo_connections)
        try:
            peer_incarnation = await open_remote(f"{self._host}:{store.port}", 1, self._gloo_connections, channel_id)
            group = await asyncio.shield(group_future)
        except BaseException:
            self._abandon((peer_address, backend), group_future)
            raise
        log.info("channel_opened", peer=peer_address, backend=backend.value, store_port=store.port,
                 channel_id=channel_id, peer_incarnation=peer_incarnation or 0)
        return PairChannel(peer_address, backend, 0, group, store, self._device_for(backend),
                           num_connections=self._gloo_connections, channel_id=channel_id,
                           peer_incarnation=peer_incarnation or 0)

    def _group_timeout_s(self, backend: TransferBackend, open_timeout_s: float) -> float:
        """gloo connects its pair within the group's timeout (each send and receive passes its own), so the
        open's bounds it; nccl connects lazily and keeps the group's timeout as every operation's for the
        channel's life, so it gets the table's, not what was left of the call that happened to open it."""
        return open_timeout_s if backend is TransferBackend.GLOO else self._timeout_s

    def _open_timeout_s(self, timeout_s: float | None) -> float:
        return self._timeout_s if timeout_s is None else max(min(self._timeout_s, timeout_s), 0.001)

    async def _rendezvous(self, slots: asyncio.Semaphore, timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.shield(await self._start_rendezvous(slots, timeout_s, fn, *args))

    async def _start_rendezvous(self, slots: asyncio.Semaphore, timeout_s: float, fn: Callable[..., Any],
                                *args: Any) -> asyncio.Future:
        """Start `fn` on a rendezvous thread, once one of `slots` is free (within `timeout_s`, else
        Unavailable). The thread counts as busy until `fn` returns, even if the caller gave up on it."""
        try:
            async with asyncio.timeout(timeout_s):
                await slots.acquire()
        except TimeoutError:
            raise Unavailable(f"all {self._max_rendezvous} rendezvous threads for channel "
                              f"{'opens' if slots is self._open_slots else 'joins'} stayed busy (with peers that "
                              f"never joined?) for {timeout_s:.3g} s; retry") from None
        self._num_rendezvous += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        future.add_done_callback(lambda _: self._rendezvous_ended(slots))
        future.add_done_callback(read_error)  # a caller that gave up (cancelled, or its open failed) reads none
        return future

    def _rendezvous_ended(self, slots: asyncio.Semaphore) -> None:
        self._num_rendezvous -= 1
        slots.release()

    def _abandon(self, key: tuple[str, TransferBackend], group_future: asyncio.Future) -> None:
        """The open failed: its rank-0 constructor gives up at the open's timeout (it holds no staging
        memory); until then, opens to that peer fail at once (`_check_not_abandoned`)."""
        if group_future.done():
            return
        self._abandoned[key] = group_future

        def ended(done: asyncio.Future) -> None:
            if self._abandoned.get(key) is done:
                del self._abandoned[key]
        group_future.add_done_callback(ended)

    def _check_not_abandoned(self, key: tuple[str, TransferBackend]) -> None:
        if key in self._abandoned:
            peer, backend = key
            raise Unavailable(f"the last {backend.value} open to {peer} still waits for it to join (up to "
                              f"{self._timeout_s:.3g} s, --channel-timeout-s); retry")


def _may_be_of(channel: PairChannel, incarnation: int) -> bool:
    """Whether `channel` may belong to that life of its peer: unless both are known and differ."""
    return not incarnation or not channel.peer_incarnation or channel.peer_incarnation == incarnation


@dataclass(slots=True)
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_users: int = 0  # callers holding or waiting for `lock`
