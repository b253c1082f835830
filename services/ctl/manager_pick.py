"""Which of ferryctl's `--admin` managers to talk to: the first to accept a connection.

Any manager answers the admin API (a standby forwards to the leader), so an operator may list
them all (`--admin HOST:PORT,HOST:PORT`) and ferryctl keeps working while one is down. The
connections are tried together, so a manager that is down costs no more than the wait for the
others; a call is never sent twice, so a Migrate or Drain runs once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from services.common.grpc_server import secure_or_insecure_channel
from services.common.tls import TlsConfig


def admin_addresses(flag_value: str) -> list[str]:
    """`--admin`'s comma-separated addresses, in order, blanks dropped."""
    return [address.strip() for address in flag_value.split(",") if address.strip()]


async def first_reachable(addresses: Sequence[str], tls: TlsConfig | None, timeout_s: float) -> str:
    """The first of `addresses` to accept a connection within `timeout_s`; the first one when one
    address is given, or when none answers (its call then fails, naming it)."""
    if len(addresses) == 1:
        return addresses[0]
    channels = {address: secure_or_insecure_channel(address, tls) for address in addresses}
    ready = {asyncio.ensure_future(channel.channel_ready()): address for address, channel in channels.items()}
    try:
        done, _ = await asyncio.wait(ready, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        reachable = {ready[task] for task in done if not task.cancelled() and task.exception() is None}
        return next((address for address in addresses if address in reachable), addresses[0])
    finally:
        for task in ready:
            task.cancel()
        for channel in channels.values():
            with contextlib.suppress(Exception):
                await channel.close()
