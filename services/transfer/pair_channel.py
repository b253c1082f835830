"""One point-to-point channel: a torch.distributed process group of two for one (sender, receiver) pair.

There is no global group: each pair gets its own TCPStore (served by the sender, rank 0)
and its own ProcessGroupGloo / ProcessGroupNCCL built with the low-level constructors
(torch allows one default group per process, and `new_group` needs it). The channel table
(channels.py) decides when to open and drop them, and runs these constructors on its
rendezvous threads.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field

import structlog
import torch
import torch.distributed as dist

from services.common.errors import FailedPrecondition, Unavailable
from services.transfer.block_copy import in_place_views
from services.transfer.chunk_plan import Chunk
from services.transfer.deadline import Deadline
from services.transfer.domain import CHANNEL_BACKENDS, TransferBackend

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
    is_retired: bool = False  # out of its table (`retire`): the transfers on it finish, no new one starts
    channel_id: int = 0  # random, chosen by the sender at the open; each ExpectBlocks names it (0: an older sender)
    peer_incarnation: int = 0  # the life of the peer that joined it (0: unknown, a peer from before the field)

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
        self.is_retired = True
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

    def check_open(self) -> None:
        """Unavailable once dropped or retired. A transfer that took the channel and then waited (its turn, a
        staging slot) checks it before its ExpectBlocks: the peer may hold a fresh channel from us by now, on
        which that call would post receives for messages that never come (held until the deadline, then
        breaking it)."""
        if self.is_retired:
            raise Unavailable(f"the {self.backend.value} channel with {self.peer} was retired (its peer left etcd) "
                              "while this transfer waited for it; retry, which opens a fresh one")
        self._live_group()

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


def move_in_place(move: Callable[[Sequence[tuple[torch.Tensor, int]], float], None], rows: torch.Tensor,
                  block_ids: tuple[int, ...], chunks: list[Chunk], transfer_tag: int, timeout_s: float) -> None:
    """(io thread) An in-place batch's rows straight from or into the KV memory `rows`, their views made
    here too: `move` is the channel's `send_in_order` (source) or `recv_in_order` (destination)."""
    views = in_place_views(rows, block_ids, chunks)
    move([(view, chunk_tag(transfer_tag, chunk.index)) for chunk, view in zip(chunks, views)], timeout_s)


def in_place_window(message_bytes: int) -> int:
    """How many rows of an in-place span to keep in flight (fewer than TAG_STRIDE, so no tag repeats among them)."""
    return max(4, min(TAG_STRIDE - 1, IN_PLACE_BYTES_IN_FLIGHT // max(message_bytes, 1)))


def chunk_tag(transfer_tag: int, chunk_index: int) -> int:
    """The tag of one chunk's message: consecutive chunks take the connections in turn."""
    return transfer_tag + chunk_index % TAG_STRIDE


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


# A pair's store and group, built on the table's rendezvous threads (ChannelTable.outgoing / accept).
def store_prefix(sender_id: str, receiver_id: str, backend: TransferBackend) -> str:
    # The store belongs to one pair, so the sender's id alone names the group.
    del receiver_id
    return f"ferry/{sender_id}/{backend.value}/"


def master_store(host: str, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, 0, world_size=2, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as exc:
        raise Unavailable(f"cannot reach the peer's TCPStore at {host}:{port}: {exc}") from exc


def create_group(backend: TransferBackend, store: dist.Store, rank: int, host: str, timeout_s: float,
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
        group = dist.ProcessGroupNCCL(store, rank, 2, options)
        # The communicator now, while both peers are in this rendezvous (as init_process_group does
        # given a device_id), not lazily inside the first send or recv, where no wait timeout bounds it
        # and a peer that has dropped its end by then would hold that io thread. The rendezvous
        # thread's current device is --nccl-device (threads.py).
        group.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return group
    except (RuntimeError, dist.DistError) as exc:
        raise Unavailable(f"{backend.value} rendezvous failed (rank {rank}): {exc}") from exc
