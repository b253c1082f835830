"""At startup, wait for etcd to answer (--etcd-wait-s): waiting mends an etcd that is down, starting, busy or
restarting; it never mends one that refuses our credentials or permissions, reported at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog
from etcd3aio import Etcd3Client, EtcdPermissionDeniedError, EtcdUnauthenticatedError

from services.common.error_text import error_text
from services.common.backoff import Backoff
from services.common.errors import FailedPrecondition, Unavailable
from services.common.etcd_client import ETCD_ERRORS
from services.common.startup import StoppedBeforeReady

log = structlog.get_logger(__name__)

_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)


async def wait_until_reachable(connect: Callable[[], Awaitable[Etcd3Client]], endpoints: Sequence[str], key: str,
                               wait_s: float, rpc_timeout_s: float, stop: asyncio.Event | None = None) -> None:
    """Return once etcd answers a read of `key`, trying for at most `wait_s` seconds; then raise Unavailable, or
    StoppedBeforeReady once `stop` is set. An etcd that refuses us raises FailedPrecondition at once."""
    deadline = time.monotonic() + wait_s
    backoff = Backoff.up_to(2.0, initial_s=0.2)
    while True:
        try:
            client = await connect()
            await client.kv.get(key, timeout=rpc_timeout_s)
        except ETCD_ERRORS as exc:
            if not _is_unreachable(exc):  # refused: waiting would not mend it
                raise FailedPrecondition(f"etcd at {','.join(endpoints)} refused us: {error_text(exc)}; check "
                                         "--etcd-user/--etcd-password and the user's role") from exc
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"etcd at {','.join(endpoints)} did not answer within --etcd-wait-s "
                                  f"{wait_s:g}: {error_text(exc)}; check that etcd runs there (--etcd-endpoints)") from exc
            if not backoff.num_attempts:
                log.warning("etcd_not_answering_waiting", endpoints=list(endpoints), wait_s=wait_s, error=error_text(exc))
            await _pause(min(backoff.next_delay(), left), stop)
        else:
            if backoff.num_attempts:
                log.info("etcd_answered", endpoints=list(endpoints), num_attempts=backoff.num_attempts + 1)
            return


def _is_unreachable(exc: BaseException) -> bool:
    """Anything but a refusal of our credentials or permissions: etcd down, starting, busy or restarting
    (waiting may mend it). etcd refuses auth with INVALID_ARGUMENT ("authentication failed", "user name is
    empty") as well as UNAUTHENTICATED and PERMISSION_DENIED."""
    if isinstance(exc, (EtcdUnauthenticatedError, EtcdPermissionDeniedError)):
        return False
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() not in _REFUSALS
    return True


async def _pause(delay_s: float, stop: asyncio.Event | None) -> None:
    """Sleep `delay_s`; StoppedBeforeReady as soon as `stop` is set."""
    if stop is None:
        await asyncio.sleep(delay_s)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), delay_s)
    if stop.is_set():
        raise StoppedBeforeReady("stopped while waiting for etcd")
