"""This instance's link to its co-located transfer service (--transfer-address).

At startup the instance maps its KV memory into the service (MapInstance: the shared-memory
name, or the CUDA IPC handle of a cache on a GPU) so the service can read and write its
blocks in place; migrations then ask it to copy blocks.
The service may still be starting: mapping is retried with backoff until
CONNECT_TIMEOUT_S, then startup fails naming the flag. A transfer service that restarts
forgets its mappings: `transfer_mapping_loop` notices (this instance is missing from its
status) and maps the KV memory again, so migrations work again without restarting us. That new life may
advertise another address (restarted with another --advertise-host), or carry another id or backends: they are
read from its status at the remap, the link takes them, and `on_changed` passes them on (the etcd record, the
reservations this instance hands its sources). Before, the address read at startup named the service until the
instance restarted, so every migration into this instance sent its blocks to the old address and failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from services.common.backoff import Backoff
from services.common.errors import FerryError, Unavailable
from services.common.periodic import periodic_loop
from services.common.tls import TlsConfig
from services.instance.engine.kv_cache import KvCache
from services.transfer.client import TransferClient
from services.transfer.convert import backend_from_proto
from services.transfer.domain import TransferBackend

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT_S = 30.0
MAPPING_CHECK_INTERVAL_S = 1.0


@dataclass(slots=True)
class TransferLink:
    """Not frozen: `transfer_mapping_loop` rewrites the service's fields when a new life of it answers (every
    holder of the link then reads the new ones: the etcd record's writer)."""

    client: TransferClient
    transfer_id: str
    backends: tuple[TransferBackend, ...] = ()  # what the service offers
    advertised: str = ""  # the address the service gives others (its --advertise-host); "": an older service

    @property
    def address(self) -> str:
        """Where this instance reaches it (--transfer-address: 127.0.0.1:P in the shipped env files)."""
        return self.client.address

    @property
    def peer_address(self) -> str:
        """Where other hosts' transfer services reach it: the service's own advertised address. A destination
        named its --transfer-address before, so with the env files' 127.0.0.1:P across machines the source's
        transfer service sent the blocks to its own host and every migration between hosts failed."""
        return self.advertised or self.address


async def connect_transfer(address: str, instance_id: str, kv_cache: KvCache, rpc_timeout_s: float,
                           tls: TlsConfig | None = None) -> TransferLink:
    """Map `kv_cache` into the transfer service at `address` under `instance_id`."""
    client = TransferClient(address, timeout_s=rpc_timeout_s, tls=tls)
    deadline = asyncio.get_running_loop().time() + CONNECT_TIMEOUT_S
    backoff = Backoff(initial_s=0.1, max_s=1.0)
    while True:
        try:
            await client.map_instance(instance_id, kv_cache.name, kv_cache.geometry, kv_cache.ipc_handle)
            status = await client.get_status()
            break
        except Unavailable as exc:
            if asyncio.get_running_loop().time() > deadline:
                await client.close()
                raise Unavailable(f"the transfer service at --transfer-address {address} did not answer within "
                                  f"{CONNECT_TIMEOUT_S:g} s ({exc.message}); start it first "
                                  "(python -m services.transfer)") from None
            await backoff.sleep()
    log.info("kv_cache_mapped", transfer_address=address, transfer_id=status.transfer_id, shm_name=kv_cache.name,
             transfer_advertised_address=status.address)
    return TransferLink(client, status.transfer_id, tuple(backend_from_proto(b) for b in status.backends),
                        status.address)


LinkChanged = Callable[[TransferLink], Awaitable[None]]


async def _unchanged(link: TransferLink) -> None:
    pass


@dataclass(slots=True)
class TransferOutage:
    """Whether the last GetStatus of the transfer service failed: an outage is logged once at warning when it
    starts and once at info when it ends, not once per check (every second)."""

    started_at: float | None = None  # loop time of the first failed check; None: the service answers
    num_failed_checks: int = 0

    def failed(self, link: TransferLink, reason: str, now: float) -> None:
        self.num_failed_checks += 1
        if self.started_at is None:
            self.started_at = now
            log.warning("transfer_status_unavailable", transfer_address=link.address, reason=reason,
                        hint="migrations to and from this instance fail until its transfer service "
                             "(--transfer-address) answers; logged once until it does")

    def answered(self, link: TransferLink, now: float) -> None:
        if self.started_at is not None:
            log.info("transfer_status_recovered", transfer_address=link.address,
                     down_s=round(now - self.started_at, 1), num_failed_checks=self.num_failed_checks)
        self.started_at, self.num_failed_checks = None, 0


async def transfer_mapping_loop(link: TransferLink, instance_id: str, kv_cache: KvCache,
                                interval_s: float = MAPPING_CHECK_INTERVAL_S, on_changed: LinkChanged = _unchanged) -> None:
    """Map `kv_cache` again whenever the transfer service no longer lists this instance (it restarted); where that
    new life advertises another address, id or backends, update `link` and await `on_changed(link)`."""
    outage = TransferOutage()
    await periodic_loop("transfer_mapping_loop", interval_s,
                        lambda: _check_mapping(link, instance_id, kv_cache, outage, on_changed))


async def _check_mapping(link: TransferLink, instance_id: str, kv_cache: KvCache, outage: TransferOutage,
                         on_changed: LinkChanged = _unchanged) -> None:
    loop = asyncio.get_running_loop()
    try:
        status = await link.client.get_status()
        outage.answered(link, loop.time())
        if instance_id not in status.instance_ids:
            await link.client.map_instance(instance_id, kv_cache.name, kv_cache.geometry, kv_cache.ipc_handle)
            log.info("kv_cache_remapped", transfer_address=link.address, shm_name=kv_cache.name)
            if _take_life(link, status):
                await on_changed(link)
    except Unavailable as exc:  # down or restarting: try again next interval
        outage.failed(link, exc.message, loop.time())
    except FerryError as exc:  # any other refusal: try again next interval (anything else: periodic_loop logs it)
        log.warning("kv_cache_remap_failed", transfer_address=link.address, reason=exc.message,
                    code=exc.grpc_code.name)


def _take_life(link: TransferLink, status: Any) -> bool:
    """Take the id, backends and advertised address of the service's life that answered `status` (its
    GetStatus reply); whether any changed."""
    life = (status.transfer_id, tuple(backend_from_proto(b) for b in status.backends), status.address)
    if life == (link.transfer_id, link.backends, link.advertised):
        return False
    log.info("transfer_service_changed", transfer_address=link.address, transfer_id=status.transfer_id,
             previous_transfer_id=link.transfer_id, transfer_advertised_address=status.address,
             previous_advertised_address=link.advertised, backends=[b.value for b in life[1]])
    link.transfer_id, link.backends, link.advertised = life
    return True


async def disconnect_transfer(link: TransferLink, instance_id: str) -> None:
    """Unmap this instance (best effort: the service may be gone already) and close the channel."""
    try:
        was_mapped = await link.client.unmap_instance(instance_id)
    except FerryError as exc:
        log.info("kv_cache_unmap_failed", instance_id=instance_id, transfer_address=link.address, reason=exc.message)
    else:
        log.info("kv_cache_unmapped", instance_id=instance_id, transfer_address=link.address, was_mapped=was_mapped)
    await link.client.close()
