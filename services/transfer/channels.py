"""Point-to-point channels: one torch.distributed process group of two per (sender, receiver) pair.

There is no global group: each pair gets its own TCPStore (served by the sender, rank 0)
and its own ProcessGroupGloo / ProcessGroupNCCL built with the low-level constructors
(torch allows one default group per process, and `new_group` needs it). Membership
changes therefore never rebuild anything; a broken channel is dropped and the next
transfer to that peer opens a fresh one.

Dropping a channel releases the group: its destructor closes the connection, which is
the only thing that wakes a peer blocked in gloo send/recv (gloo's unbound-buffer send
waits for the matching recv; `abort()`/`shutdown()` do not interrupt it, measured on
torch 2.13). So every table reference goes away on failure, and callers keep none.
A send blocked on this side holds its connection open itself, though, so the destructor
waits for it: dropping an outgoing gloo channel first closes its connections (gloo closes
them when a wait times out), which ends those sends at once, not at their deadline.

A gloo group may hold several TCP connections (`--gloo-connections`; gloo uses
`tag % connections` for a message), so chunks sent with consecutive tags travel on the
connections in turn, several at once: one gloo connection fills about half of what a
socket carries here, because its sender waits in epoll between non-blocking writes.

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
import datetime
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping, Sequence
from typing import Any
from concurrent.futures import Executor
from dataclasses import dataclass, field

import structlog
import torch
import torch.distributed as dist

from services.common.errors import FailedPrecondition, Unavailable
from services.transfer.chunk_plan import Chunk
from services.transfer.deadline import Deadline
from services.transfer.domain import CHANNEL_BACKENDS, IDLE_CLOSE_S, TransferBackend
from services.transfer.threads import NUM_RENDEZVOUS_THREADS, retrieve_error

log = structlog.get_logger(__name__)

MAX_GLOO_CONNECTIONS = 16
TAG_STRIDE = 64  # a transfer's tags: chunk i of a transfer with tag t travels with t + i % TAG_STRIDE
MAX_TAG = 2**31 - TAG_STRIDE  # gloo and nccl tags are 32-bit signed

IN_PLACE_BYTES_IN_FLIGHT = 128 << 20  # posted ahead from one thread; receives land in the KV itself, so it costs no memory

# How this process's NCCL groups handle a failure (read when a group is built). With a blocking wait, a
# `wait(timeout)` blocks until the message moved, and on a failure or timeout aborts the communicator
# (so no receive lands later in a reused buffer) and raises; and no watchdog thread runs, whose default
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) takes the whole process down when a peer dies mid-transfer.
NCCL_ENVIRONMENT = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

OpenRemote = Callable[[str, int, int], Awaitable[None]]  # (store_address, rank, connections) → the peer joined


@dataclass(slots=True)
class PairChannel:
    peer: str  # the peer's address (outgoing) or transfer id (incoming)
    backend: TransferBackend
    rank: int
    group: dist.ProcessGroup | None  # None once dropped (`close`)
    store: dist.Store | None  # kept alive as long as the group
    device: torch.device  # where tensors must live for this backend
    bounce: torch.Tensor | None = None  # NCCL: device buffer for host staging memory
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)  # serial channels: one transfer on it at a time
    last_used: float = field(default_factory=time.monotonic)  # when a transfer last took it
    num_connections: int = 1  # gloo: TCP connections of the group (a message takes tag % num_connections)
    num_transfers: int = 0  # transfers on it now (`in_use`)
    # Out of its table because its peer is gone: called (once) with the channel when no transfer uses it.
    close_when_unused: Callable[[PairChannel], None] | None = None

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Count a transfer on the channel for its duration: a retired channel closes when the last one ends."""
        self.num_transfers += 1
        try:
            yield
        finally:
            self.num_transfers -= 1
            if self.close_when_unused is not None and not self.num_transfers:
                close, self.close_when_unused = self.close_when_unused, None
                close(self)

    def retire(self, close: Callable[[PairChannel], None]) -> None:
        """Its peer is gone: `close(self)` now if no transfer uses it, else once the last one ends (one on
        a dead peer fails by its deadline; one on a peer only briefly away completes)."""
        if self.num_transfers:
            self.close_when_unused = close
        else:
            close(self)

    @property
    def is_serial(self) -> bool:
        """One message of a transfer in flight at a time (nccl: they share the bounce buffer);
        gloo takes as many as the transfer has staging buffers for."""
        return self.backend is TransferBackend.NCCL

    @contextlib.asynccontextmanager
    async def transfer_turn(self, deadline: Deadline) -> AsyncIterator[None]:
        """Hold the channel for one whole transfer if it is serial: NCCL has no tags and pairs each
        receive with the peer's sends in the order they were posted, so two transfers at once (two
        staging slots) would swap their chunks, undetected. gloo matches by tag: no wait."""
        if not self.is_serial:
            yield
            return
        try:
            async with asyncio.timeout(deadline.remaining_s()):
                await self.turn.acquire()
        except TimeoutError:
            raise Unavailable(f"the {self.backend.value} channel to {self.peer} stayed busy with other transfers "
                              "until this one's deadline; retry") from None
        try:
            yield
        finally:
            self.turn.release()

    @property
    def moves_in_place(self) -> bool:
        """Chunks that lie contiguously in host KV memory go as they lie, with no staging copy
        (gloo reads and writes host memory itself; nccl goes through its device bounce buffer)."""
        return self.backend is TransferBackend.GLOO

    def send(self, data: torch.Tensor, tag: int, timeout_s: float) -> None:
        """Blocking send of a flat uint8 tensor to the peer (worker thread only); Unavailable if it breaks."""
        data = self._to_device(data)
        with self._broken_is_unavailable("send to"):
            self._live_group().send([data], 1 - self.rank, tag).wait(datetime.timedelta(seconds=timeout_s))

    def recv(self, out: torch.Tensor, tag: int, timeout_s: float) -> None:
        """Blocking receive into a flat uint8 tensor (worker thread only); Unavailable if it breaks."""
        target = out if out.device == self.device else self._bounce_for(out)
        with self._broken_is_unavailable("receive from"):
            self._live_group().recv([target], 1 - self.rank, tag).wait(datetime.timedelta(seconds=timeout_s))
        if target is not out:
            out.copy_(target)

    def send_in_order(self, messages: Sequence[tuple[torch.Tensor, int]], timeout_s: float) -> None:
        """Blocking send of flat host tensors with their tags, several in flight (`in_place_window`),
        posted from this one thread in order (gloo only; worker thread only)."""
        with self._broken_is_unavailable("send to"):
            self._move_in_order(messages, timeout_s, is_send=True)

    def recv_in_order(self, messages: Sequence[tuple[torch.Tensor, int]], timeout_s: float) -> None:
        """Blocking receive into flat host tensors, as `send_in_order` sends them."""
        with self._broken_is_unavailable("receive from"):
            self._move_in_order(messages, timeout_s, is_send=False)

    def close(self) -> None:
        """Let go of the group, so that it is destroyed (closing its connections) as soon as no call is
        inside it, even while a failed transfer's frames (in some traceback) still hold this channel.
        The sending end (rank 0 on gloo) first closes its connections, ending its own blocked sends."""
        group, self.group, self.store, self.bounce = self.group, None, None, None
        if group is not None and self.rank == 0 and self.backend is TransferBackend.GLOO:
            _close_gloo_connections(group, self.num_connections)

    def _live_group(self) -> dist.ProcessGroup:
        group = self.group
        if group is None:
            raise Unavailable(f"the {self.backend.value} channel with {self.peer} was dropped (a transfer on it "
                              "failed); retry")
        return group

    def _move_in_order(self, messages: Sequence[tuple[torch.Tensor, int]], timeout_s: float, is_send: bool) -> None:
        """(No local holds the group, so a traceback of this frame cannot keep it alive.)"""

        if not self.moves_in_place:
            raise FailedPrecondition(f"{self.backend.value} channels move staged chunks only")
        window = in_place_window(messages[0][0].numel()) if messages else 1
        deadline = time.monotonic() + timeout_s
        in_flight: deque[dist.Work] = deque()
        try:
            for data, tag in messages:
                if len(in_flight) >= window:
                    _wait(in_flight.popleft(), deadline)
                group = self._live_group()
                in_flight.append(group.send([data], 1 - self.rank, tag) if is_send else
                                 group.recv([data], 1 - self.rank, tag))
                del group
            while in_flight:
                _wait(in_flight.popleft(), deadline)
        except BaseException:
            # Let the others end too before giving up (each completes, fails, or times out at the
            # deadline, which closes its connection): a receive left posted on a live connection
            # could still write into KV blocks the caller is about to free.
            for work in in_flight:
                with contextlib.suppress(RuntimeError):
                    _wait(work, deadline)
            raise

    @contextlib.contextmanager
    def _broken_is_unavailable(self, action: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # gloo: peer closed the connection, timed out, or the channel was aborted
            raise Unavailable(f"{self.backend.value} {action} {self.peer} failed: {exc}") from exc

    def _to_device(self, data: torch.Tensor) -> torch.Tensor:
        if data.device == self.device:
            return data
        bounce = self._bounce_for(data)
        bounce.copy_(data)
        return bounce

    def _bounce_for(self, data: torch.Tensor) -> torch.Tensor:
        if self.bounce is None or self.bounce.numel() < data.numel():
            self.bounce = torch.empty(data.numel(), dtype=torch.uint8, device=self.device)  # once per channel
        return self.bounce[:data.numel()]


def _close_gloo_connections(group: dist.ProcessGroup, num_connections: int) -> None:
    """Close every connection of a sending gloo group: a wait that times out makes gloo close the
    connection it waited on, and a receive on the sending end never completes (its peer only
    receives), so a 1 ms receive on each connection (tag % num_connections picks it) does it."""
    scratch = torch.empty(1, dtype=torch.uint8)
    for tag in range(num_connections):
        with contextlib.suppress(RuntimeError):  # the expected timeout, or a connection already closed
            group.recv([scratch], 1, tag).wait(datetime.timedelta(milliseconds=1))


def _wait(work: dist.Work, deadline: float) -> None:
    work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


def span_messages(chunks: Sequence[Chunk], views: Sequence[torch.Tensor], transfer_tag: int
                  ) -> list[tuple[torch.Tensor, int]]:
    """The (flat view, tag) messages of an in-place span's rows."""
    return [(view, chunk_tag(transfer_tag, chunk.index)) for chunk, view in zip(chunks, views)]


def in_place_window(message_bytes: int) -> int:
    """How many rows of an in-place span to keep in flight (fewer than TAG_STRIDE, so no tag repeats among them)."""
    return max(4, min(TAG_STRIDE - 1, IN_PLACE_BYTES_IN_FLIGHT // max(message_bytes, 1)))


def chunk_tag(transfer_tag: int, chunk_index: int) -> int:
    """The tag of one chunk's message: consecutive chunks take the connections in turn."""
    return transfer_tag + chunk_index % TAG_STRIDE



class ChannelTable:
    """Channels by peer: outgoing ones keyed by the peer's address, incoming by its transfer id.

    A peer that restarts comes back under a new address or id (the default port is 0), and its old
    channels would hold their connections, threads and store for good. So a channel no transfer has
    taken for `idle_close_s` is dropped when the next channel opens, and an outgoing one is opened
    afresh rather than used after such a pause; incoming ones are dropped after twice that. So the
    sender, who drops first, never sends on a channel its peer has already dropped (a transfer
    takes both ends, so the receiver's idle time is never shorter). `idle_close_s` must be well above
    the longest transfer (the app passes at least 4 x --transfer-timeout-s)."""

    def __init__(self, transfer_id: str, host: str, timeout_s: float, executor: Executor,
                 gloo_connections: int = 1, nccl_device: int = 0, idle_close_s: float = IDLE_CLOSE_S,
                 max_rendezvous: int = NUM_RENDEZVOUS_THREADS) -> None:
        """`executor`: the rendezvous threads (2 x `max_rendezvous`: opens and joins); `timeout_s`: the longest
        an open or join waits."""
        self._transfer_id = transfer_id
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
        time) or the table's timeout, if shorter; then Unavailable."""
        check_backend_available(backend, self._nccl_device)
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
                     num_connections: int, timeout_s: float | None = None) -> None:
        """Join the group the peer opened (replacing an older channel from it), within `timeout_s`
        (the OpenChannel call's) or the table's timeout, if shorter."""
        check_backend_available(backend, self._nccl_device)
        timeout_s = self._open_timeout_s(timeout_s)
        host, _, port = store_address.rpartition(":")
        store = await self._rendezvous(self._join_slots, timeout_s, _client_store, host, int(port), timeout_s)
        prefix = dist.PrefixStore(_prefix(peer_id, self._transfer_id, backend), store)
        group = await self._rendezvous(self._join_slots, timeout_s, _create_group, backend, prefix, rank, self._host,
                                       self._group_timeout_s(backend, timeout_s), num_connections)
        self.drop_incoming(peer_id, backend)
        self._drop_idle()
        self._incoming[(peer_id, backend)] = PairChannel(peer_id, backend, rank, group, store, self._device_for(backend))
        log.info("channel_accepted", peer_transfer_id=peer_id, backend=backend.value, store_address=store_address)

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

    def incoming(self, peer_id: str, backend: TransferBackend) -> PairChannel:
        channel = self._incoming.get((peer_id, backend))
        if channel is None:
            # Dropped (a transfer on it failed here, or it idled out) or never opened (this service restarted
            # under the same id): the sender's end is stale, and a retry opens afresh. Not a precondition:
            # a migration takes those for a refusal and does not retry.
            raise Unavailable(f"no {backend.value} channel from transfer service {peer_id!r} (this end was dropped "
                              "after a failed transfer, or never opened); retry, which opens a fresh one")
        channel.last_used = time.monotonic()
        return channel

    def drop_outgoing(self, peer_address: str, backend: TransferBackend, only: PairChannel | None = None) -> None:
        """`only`: close that channel, and take it out of the table if it is still there (not one opened since)."""
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

    def close_outgoing(self, peer_address: str) -> int:
        """A peer transfer service is gone (`PeerWatch`): take the channels to `peer_address` out of the table
        and close each now, or once the transfers on it end (`PairChannel.retire`). Returns how many."""
        return self._retire(self._outgoing, peer_address, "outgoing")

    def close_incoming(self, peer_id: str) -> int:
        """The same for the channels from transfer service `peer_id`."""
        return self._retire(self._incoming, peer_id, "incoming")

    def _retire(self, channels: dict[tuple[str, TransferBackend], PairChannel], peer: str, direction: str) -> int:
        gone = [(key, channels.pop(key)) for key in list(channels) if key[0] == peer]
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
        if (error := retrieve_error(future)) is not None:
            log.warning("close_failed", what="channel", error=repr(error))

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
        store = await self._rendezvous(self._open_slots, timeout_s, _master_store, self._host, timeout_s)
        prefix = dist.PrefixStore(_prefix(self._transfer_id, "", backend), store)
        # On its thread before the peer is asked to join: a join never waits for an open still waiting for a thread.
        group_future = await self._start_rendezvous(self._open_slots, timeout_s, _create_group, backend, prefix, 0,
                                                    self._host, self._group_timeout_s(backend, timeout_s),
                                                    self._gloo_connections)
        try:
            await open_remote(f"{self._host}:{store.port}", 1, self._gloo_connections)
            group = await asyncio.shield(group_future)
        except BaseException:
            self._abandon((peer_address, backend), group_future)
            raise
        log.info("channel_opened", peer=peer_address, backend=backend.value, store_port=store.port)
        return PairChannel(peer_address, backend, 0, group, store, self._device_for(backend),
                           num_connections=self._gloo_connections)

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
        future.add_done_callback(retrieve_error)  # a caller that gave up (cancelled, or its open failed) reads none
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


@dataclass(slots=True)
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_users: int = 0  # callers holding or waiting for `lock`


def configure_nccl(environ: MutableMapping[str, str]) -> None:
    """Set NCCL_ENVIRONMENT in the process environment, once at startup (before any thread reads it);
    values an operator set are overridden, with a warning: the others break the failure handling."""
    for name, value in NCCL_ENVIRONMENT.items():
        if environ.get(name, value) != value:
            log.warning("nccl_environment_overridden", variable=name, was=environ[name], now=value)
        environ[name] = value


def check_backend_available(backend: TransferBackend, nccl_device: int = 0) -> None:
    if backend not in CHANNEL_BACKENDS:
        raise FailedPrecondition(f"backend {backend.value} does not use channels")
    if backend is TransferBackend.NCCL and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise FailedPrecondition("backend nccl needs CUDA and a torch build with NCCL; use --backends grpc,gloo here")
    if backend is TransferBackend.NCCL and nccl_device >= torch.cuda.device_count():
        raise FailedPrecondition(f"--nccl-device {nccl_device}: only {torch.cuda.device_count()} CUDA device(s) "
                                 "are visible to this transfer service")
    if backend is TransferBackend.GLOO and not dist.is_gloo_available():
        raise FailedPrecondition("backend gloo needs a torch build with gloo; use grpc")


def _prefix(sender_id: str, receiver_id: str, backend: TransferBackend) -> str:
    # The store belongs to one pair, so the sender's id alone names the group.
    del receiver_id
    return f"ferry/{sender_id}/{backend.value}/"


def _master_store(host: str, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, 0, world_size=2, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as exc:
        raise Unavailable(f"cannot reach the peer's TCPStore at {host}:{port}: {exc}") from exc


def _create_group(backend: TransferBackend, store: dist.Store, rank: int, host: str, timeout_s: float,
                  num_connections: int) -> dist.ProcessGroup:
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend is TransferBackend.GLOO:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host) for _ in range(num_connections)]
            return dist.ProcessGroupGloo(store, rank, 2, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    except (RuntimeError, dist.DistError) as exc:
        raise Unavailable(f"{backend.value} rendezvous failed (rank {rank}): {exc}") from exc
