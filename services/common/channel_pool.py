"""Client channels to peers that come and go (instances), one per address, made on first use.

A fleet that scales and restarts instances on fresh ports meets new addresses for as long
as it runs, so channels are not kept for ever: one that no call has used for `idle_close_s`
is closed when the next new address is dialled. A channel is never closed under a call
(`use` counts them, streams included), so a long generation keeps its channel.

A channel whose peer went away sits in gRPC's reconnect backoff (TRANSIENT_FAILURE) and
fails every call at once with its last error, even after the peer is back on the same
port (a restarted instance): such a channel is replaced by a fresh one, which dials at
once, and closed when its last call ends. Channels keep their own connections
(`grpc.use_local_subchannel_pool`), or the fresh one would share the old one's backoff.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from services.common.grpc_server import secure_or_insecure_channel
from services.common.tls import TlsConfig

IDLE_CLOSE_S = 600.0
OWN_CONNECTIONS = [("grpc.use_local_subchannel_pool", 1)]


@dataclass(slots=True)
class _Entry:
    channel: grpc.aio.Channel
    num_calls: int = 0
    last_used: float = 0.0  # when the last call ended (a channel in use is never idle)


class ChannelPool:
    def __init__(self, tls: TlsConfig | None = None, idle_close_s: float = IDLE_CLOSE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tls = tls
        self._idle_close_s = idle_close_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._retired: list[_Entry] = []  # replaced, closed once their last call ends (or by close())

    @contextlib.asynccontextmanager
    async def use(self, address: str) -> AsyncIterator[grpc.aio.Channel]:
        """The channel to `address`, kept open until the block ends."""
        entry = self._entries.get(address)
        retired = None
        if entry is not None and entry.channel.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            retired, entry = entry, None  # backing off from a peer that may be back: dial afresh
            self._retired.append(retired)
        is_new = entry is None
        if entry is None:
            entry = self._entries[address] = _Entry(secure_or_insecure_channel(address, self._tls, OWN_CONNECTIONS))
        entry.num_calls += 1
        try:
            if retired is not None:
                await self._close_if_done(retired)
            if is_new:
                await self._close_idle()
            yield entry.channel
        finally:
            entry.num_calls -= 1
            entry.last_used = self._clock()
            await self._close_if_done(entry)

    @property
    def addresses(self) -> list[str]:
        return list(self._entries)

    async def close(self) -> None:
        entries, self._entries, self._retired = [*self._entries.values(), *self._retired], {}, []
        for entry in entries:
            await entry.channel.close()

    async def _close_if_done(self, entry: _Entry) -> None:
        if entry.num_calls == 0 and any(entry is retired for retired in self._retired):
            self._retired = [retired for retired in self._retired if retired is not entry]
            await entry.channel.close()

    async def _close_idle(self) -> None:
        for address in list(self._entries):
            entry = self._entries.get(address)
            if entry is not None and entry.num_calls == 0 and self._clock() - entry.last_used >= self._idle_close_s:
                del self._entries[address]
                await entry.channel.close()
