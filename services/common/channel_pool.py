"""Client channels to peers that come and go (instances), one per address, made on first use.

Spellings of one address (`localhost:P`, `127.0.0.1:P`; `[::1]:P`, `::1:P`) share a channel: it is
keyed by `peer_key` and dials the spelling it was first asked for.

A fleet that scales and restarts instances on fresh ports meets new addresses for as long
as it runs, so channels are not kept for ever (`IdleClosingTable`): one that no call has used for
`idle_close_s` is closed when the next new address is dialled. A channel is never closed
under a call (`use` counts them, streams included), so a long generation keeps its channel.

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

import grpc

from services.common.grpc_server import secure_or_insecure_channel
from services.common.idle_table import IDLE_CLOSE_S, Entry, IdleClosingTable, Usage
from services.common.peer_address import peer_key
from services.common.tls import TlsConfig

OWN_CONNECTIONS = [("grpc.use_local_subchannel_pool", 1)]


class ChannelPool:
    def __init__(self, tls: TlsConfig | None = None, idle_close_s: float = IDLE_CLOSE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tls = tls
        self._table: IdleClosingTable[grpc.aio.Channel] = IdleClosingTable(
            _close_channel, "pooled_channel", idle_close_s, clock)
        self._retired: list[Entry[grpc.aio.Channel]] = []  # replaced, closed once their last call ends (or by close())

    @contextlib.asynccontextmanager
    async def use(self, address: str) -> AsyncIterator[grpc.aio.Channel]:
        """The channel to `address`, kept open until the block ends."""
        key = peer_key(address)
        retired = self._retire_if_backing_off(key)
        is_new = self._table.get(key) is None
        entry = self._table.take(key, self._dial(address))
        try:
            with entry.usage.call():
                if retired is not None:
                    await self._close_if_done(retired)
                if is_new:
                    await self._table.wait_closed()  # the idle channels this new address closed
                yield entry.value
        finally:
            await self._close_if_done(entry)

    @property
    def addresses(self) -> list[str]:
        """The open channels' addresses, each as `peer_key` spells it."""
        return self._table.addresses

    async def close(self) -> None:
        retired, self._retired = self._retired, []
        await self._table.close()
        for entry in retired:
            await entry.value.close()

    def _dial(self, address: str) -> Callable[[Usage], grpc.aio.Channel]:
        return lambda _usage: secure_or_insecure_channel(address, self._tls, OWN_CONNECTIONS)

    def _retire_if_backing_off(self, key: str) -> Entry[grpc.aio.Channel] | None:
        """A channel backing off from a peer that may be back is replaced (dialled afresh)."""
        entry = self._table.get(key)
        if entry is None or entry.value.get_state() is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            return None
        self._table.pop(key)
        self._retired.append(entry)
        return entry

    async def _close_if_done(self, entry: Entry[grpc.aio.Channel]) -> None:
        if entry.usage.num_calls == 0 and any(entry is retired for retired in self._retired):
            self._retired = [retired for retired in self._retired if retired is not entry]
            await entry.value.close()


async def _close_channel(channel: grpc.aio.Channel) -> None:
    await channel.close()
