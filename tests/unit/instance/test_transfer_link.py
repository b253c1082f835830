"""The instance's link to its transfer service survives whatever the service answers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from services.common.errors import Internal, Unavailable
from services.instance.transfer_link import TransferLink, transfer_mapping_loop
from services.transfer.convert import backend_to_proto
from services.transfer.domain import TransferBackend
from tests.unit.loop_checks import assert_cancels, until

pytestmark = pytest.mark.timeout(30)


@dataclass
class FlakyTransferClient:
    """A restarted transfer service: first down, then refusing, then without our mapping."""

    answers: list[BaseException | list[str]]
    address: str = "127.0.0.1:1"
    mapped: list[str] = field(default_factory=list)
    advertised: str = ""  # what its GetStatus says the service's address is

    async def get_status(self):
        answer = self.answers.pop(0) if self.answers else ["instance-0"]
        if isinstance(answer, BaseException):
            raise answer
        return SimpleNamespace(instance_ids=answer, transfer_id="transfer-0", address=self.advertised,
                               backends=[backend_to_proto(TransferBackend.GRPC)])

    async def map_instance(self, instance_id: str, shm_name: str, geometry, cuda_ipc=None) -> int:
        self.mapped.append(instance_id)
        return 0


async def test_mapping_loop_outlives_refusals_and_maps_again():
    client = FlakyTransferClient([Unavailable("restarting"), Internal("not registered yet"), []])
    cache = SimpleNamespace(name="ferry-kv-test", geometry=None, ipc_handle=None)
    loop = asyncio.create_task(transfer_mapping_loop(TransferLink(client, "transfer-0"), "instance-0", cache,
                                                     interval_s=0.01))
    try:
        while not client.mapped:
            assert not loop.done(), loop.exception()
            await asyncio.sleep(0.01)
    finally:
        loop.cancel()
    assert client.mapped == ["instance-0"]


async def test_a_new_life_advertising_another_address_is_followed():
    """A transfer service restarted with another --advertise-host: the remap takes its new address (and id and
    backends), and `on_changed` passes it on, once; a restart that changed nothing calls nothing."""
    client = FlakyTransferClient([[], ["instance-0"], []], advertised="10.0.0.2:7000")
    link = TransferLink(client, "transfer-0", (TransferBackend.GRPC,), "10.0.0.1:7000")
    changed: list[tuple[str, str]] = []

    async def on_changed(new: TransferLink) -> None:
        changed.append((new.peer_address, new.transfer_id))
    cache = SimpleNamespace(name="ferry-kv-test", geometry=None, ipc_handle=None)
    loop = asyncio.create_task(transfer_mapping_loop(link, "instance-0", cache, interval_s=0.01, on_changed=on_changed))
    await until(lambda: len(client.mapped) == 2, loop)
    await assert_cancels(loop)
    assert changed == [("10.0.0.2:7000", "transfer-0")]
    assert (link.peer_address, link.backends) == ("10.0.0.2:7000", (TransferBackend.GRPC,))


async def test_mapping_loop_outlives_any_error_and_cancels():
    client = FlakyTransferClient([RuntimeError("boom"), KeyError("instance_ids"), []])
    cache = SimpleNamespace(name="ferry-kv-test", geometry=None, ipc_handle=None)
    loop = asyncio.create_task(transfer_mapping_loop(TransferLink(client, "transfer-0"), "instance-0", cache,
                                                     interval_s=0.01))
    await until(lambda: bool(client.mapped), loop)
    assert client.mapped == ["instance-0"]
    await assert_cancels(loop)


@pytest.mark.parametrize("outcome", [True, False, Unavailable("the transfer service at 127.0.0.1:1 did not answer")])
async def test_disconnecting_logs_which_instance_was_unmapped_where_or_why_not(outcome):
    """The instance logged nothing when its unmap succeeded or found nothing mapped, and a failure without
    the instance id."""
    from structlog.testing import capture_logs

    from services.instance.transfer_link import disconnect_transfer

    class Client:
        address = "127.0.0.1:1"

        async def unmap_instance(self, instance_id: str) -> bool:
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        async def close(self) -> None:
            pass
    with capture_logs() as logs:
        await disconnect_transfer(TransferLink(Client(), "t-0"), "instance-0")
    (entry,) = logs
    assert entry["instance_id"] == "instance-0" and entry["transfer_address"] == "127.0.0.1:1"
    if isinstance(outcome, bool):
        assert entry["event"] == "kv_cache_unmapped" and entry["was_mapped"] is outcome
    else:
        assert entry["event"] == "kv_cache_unmap_failed"


async def test_a_transfer_service_outage_is_one_warning_and_one_recovery_line():
    """`transfer_status_unavailable` was at debug: an operator never saw that the instance could not reach its
    transfer service (every migration to or from it failing). Logged every second it would flood the log."""
    from structlog.testing import capture_logs

    from services.instance.transfer_link import TransferOutage, _check_mapping

    down = [Unavailable("connection refused")] * 5
    client = FlakyTransferClient([*down, ["instance-0"], ["instance-0"], *down[:2], ["instance-0"]])
    cache = SimpleNamespace(name="ferry-kv-test", geometry=None, ipc_handle=None)
    outage, link = TransferOutage(), TransferLink(client, "transfer-0")
    with capture_logs() as logs:
        for _ in range(10):
            await _check_mapping(link, "instance-0", cache, outage)
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("transfer_status_unavailable", "warning"), ("transfer_status_recovered", "info"),
        ("transfer_status_unavailable", "warning"), ("transfer_status_recovered", "info")]
    assert logs[0]["reason"] == "connection refused" and "--transfer-address" in logs[0]["hint"]
    assert [e["num_failed_checks"] for e in logs[1::2]] == [5, 2] and client.mapped == []
