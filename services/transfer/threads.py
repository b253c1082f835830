"""The worker threads of a transfer service, and how coroutines wait for them.

* `copy`: one thread; gathers and scatters run there in chunk order (checksums chain
  over row chunks, and a pipeline never has two copies of one transfer in flight).
* `io`: blocking channel sends/receives: enough threads for every staging buffer of every
  slot in both directions to wait at once (a send waits for the peer's receive, so a short
  pool could leave both sides waiting for threads).
* `rendezvous`: channel opens (stores, group constructors), apart from `io`: an open whose
  peer never joins blocks its thread until the open's timeout, and must not take a thread a
  transfer waits for. The channel table runs at most `rendezvous_threads` opens and as many
  joins at once (no queue).

Torch and numpy copies and gloo waits release the GIL, so all of these run while the event loop serves.

With nccl, the `io` and `rendezvous` threads make `--nccl-device` their current CUDA device when they
start: the CUDA current device is per thread and starts at 0, and NCCL expects it set to the
communicator's device (torch: `torch.cuda.set_device`) where groups are built and their messages
posted and waited for; a service on GPU 1 would otherwise also open a context on GPU 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from services.common.task_errors import read_error

NUM_RENDEZVOUS_THREADS = 4  # opens at once, and as many joins


@dataclass(frozen=True, slots=True)
class TransferThreads:
    copy: Executor
    io: Executor
    rendezvous: Executor
    rendezvous_threads: int = NUM_RENDEZVOUS_THREADS

    @classmethod
    def start(cls, buffers_per_direction: int, nccl_device: torch.device | None = None) -> TransferThreads:
        """`buffers_per_direction`: staging buffers of all slots of one pool; `nccl_device`: the CUDA device
        of this service's nccl channels, if it offers nccl."""
        on_device = {} if nccl_device is None else {"initializer": torch.cuda.set_device, "initargs": (nccl_device,)}
        return cls(ThreadPoolExecutor(1, thread_name_prefix="kv-copy"),
                   ThreadPoolExecutor(2 * buffers_per_direction, thread_name_prefix="kv-io", **on_device),
                   ThreadPoolExecutor(2 * NUM_RENDEZVOUS_THREADS, thread_name_prefix="kv-rendezvous", **on_device))

    def shutdown(self) -> None:
        """Wait for copies (they touch KV memory that is unmapped next); leave blocked channel
        operations and opens behind (their channels are already dropped, which ends them)."""
        self.copy.shutdown(wait=True, cancel_futures=True)
        self.io.shutdown(wait=False, cancel_futures=True)
        self.rendezvous.shutdown(wait=False, cancel_futures=True)  # opens give up at their timeout


async def run_in_thread(executor: Executor, fn: Callable[..., Any], *args: Any,
                        on_cancel: Callable[[], None] | None = None) -> Any:
    """Run `fn` on `executor`; if the caller is cancelled, call `on_cancel` (what ends a thread blocked on a
    peer: dropping its channel) and wait for the thread before re-raising."""
    future = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        await wait_for_threads([future])  # the thread may still touch staging memory; a cancelled shield reads no error
        raise


async def wait_for_threads(futures: Iterable[asyncio.Future]) -> None:
    """Wait until every future (a thread's work) is done and read their errors, also when the caller is
    cancelled meanwhile (the cancel is raised after): a thread cannot be stopped and may still use staging
    memory, which its caller gives back next. Bounded: each thread's work has its transfer's deadline."""
    futures = list(futures)
    is_cancelled = False
    while pending := [future for future in futures if not future.done()]:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            is_cancelled = True
    for future in futures:
        read_error(future)  # a broken channel fails every transfer in flight; the caller raises the first
    if is_cancelled:
        raise asyncio.CancelledError

