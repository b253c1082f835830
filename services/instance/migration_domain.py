"""Migration domain types: what one migration out is asked and set up with, what the destination
reserved for it, what it did, and the two peers the driver (migration.py) calls, as protocols."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.instance.engine.migration_state import HeldRequest, MigrationSelection, RequestState
from services.transfer.domain import BlockTransfer, TransferBackend, TransferResult


class RefusedByDestination(FailedPrecondition):
    """The destination turned the move down at its first PrepareMigrateIn by a precondition of its own (its role
    is PREFILL now), with its message: another destination may take the request. A FAILED_PRECONDITION of the
    source's own (no --transfer-address) is a plain FailedPrecondition: every destination would meet it."""


class RefusedByTransfer(ResourceExhausted):
    """A transfer service on the way (this instance's, or the destination's) had no room for a copy: its staging
    slots stayed busy. Told apart from the destination's refusal for want of room (MigrateOut's trailing metadata
    `x-ferry-refused-by`): the destination had room, and the manager records a fault, not a refusal."""


@dataclass(frozen=True, slots=True)
class MigrateOutPlan:
    request_id: str  # "" = pick one by `selection`
    dst_instance_id: str
    dst_address: str  # the destination instance's gRPC address
    dst_transfer_address: str  # "" = the one the destination reports
    backend: TransferBackend | None  # None = this instance's --transfer-backend
    selection: MigrationSelection = MigrationSelection.SHORTEST_RUNNING
    exclude_request_ids: frozenset[str] = frozenset()  # never picked (e.g. the manager's cooldown)
    max_stages: int | None = None  # live stages; None = --migration-max-stages, 0 = one stop-and-copy (PD hand-off)
    held: HeldRequest | None = None  # parked with its state already (PD hand-off): no engine call to suspend it
    # the first PrepareMigrateIn's deadline where shorter than --migration-rpc-timeout-s (a PD hand-off, whose request
    # waits parked meanwhile: --pd-handoff-hold-s); None = that flag
    prepare_timeout_s: float | None = None
    can_decode_on_prefill: bool = False  # a PREFILL destination chosen on purpose (a drain with nowhere else to go)
    dst_max_model_len: int = 0  # the destination's max_model_len (0: not known): a pick by `selection` fits it


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    instance_id: str
    transfer_backend: TransferBackend | None  # --transfer-backend; None = auto (`auto_backend`)
    stage_blocks: int  # --migration-stage-blocks: stop and copy once this few blocks remain
    max_stages: int  # --migration-max-stages: live stages before stop-and-copy anyway
    is_checksum_verified: bool  # --verify-transfer-checksum
    rpc_timeout_s: float  # --migration-rpc-timeout-s: each Prepare/Commit/Abort call
    transfer_timeout_s: float  # --migration-transfer-timeout-s: each stage's copy
    reservation_timeout_s: float  # --migration-reservation-timeout-s, assumed the same on the destination
    transfer_id: str = ""  # this instance's co-located transfer service ("" = unknown: auto picks grpc)
    offered_backends: tuple[TransferBackend, ...] = ()  # what that service offers

    @property
    def touch_interval_s(self) -> float:
        """A reservation last prepared this long ago may expire before a copy that starts now, and the commit
        after it, end (each may take its whole deadline); the instance's config keeps it above 0 (at or below,
        every copy would refresh it first, and a copy and commit taking their deadlines could still outlive it)."""
        return self.reservation_timeout_s - self.transfer_timeout_s - self.rpc_timeout_s


@dataclass(frozen=True, slots=True)
class MigrationResult:
    request_id: str
    src_instance_id: str
    dst_instance_id: str
    num_blocks: int  # blocks copied, every stage together
    num_bytes: int
    num_stages: int  # live stages + the final stop-and-copy stage
    backend: TransferBackend
    duration_ms: float  # MigrateOut start (or, for a request held for its PD hand-off, its holding) → stream handed off
    downtime_ms: float  # suspended here → committed on the destination
    num_cached_at_destination: int = 0  # leading blocks the destination had cached, with our bits: never sent


@dataclass(frozen=True, slots=True)
class Reservation:
    """What the destination set aside (PrepareMigrateInResponse)."""

    block_ids: tuple[int, ...]  # in the request's block-table order
    transfer_address: str  # the transfer service mapping the destination's KV memory
    transfer_id: str
    num_cached_blocks: int = 0  # leading block_ids the destination had cached: shared there, never copied into
    write_grant: int = 0  # named in every transfer into block_ids (the destination's fence; 0 = none)
    cached_checksums: tuple[int, ...] = ()  # first answer: crc32 of each cached block (empty: an older destination)
    num_not_held: int = 0  # first answer: the leading entries kept as placeholders (behind the window; 0: older)


class DestinationPeer(Protocol):
    """The destination instance's migration RPCs (services/instance/client.py)."""

    async def prepare_migrate_in(self, migration_id: str, request_id: str, src_instance_id: str,
                                 num_blocks: int, grow_only: bool = False,
                                 block_hashes: Sequence[bytes] = (), timeout_s: float | None = None,
                                 keep_cached_blocks: int | None = None, max_num_tokens: int = 0,
                                 can_decode_on_prefill: bool = False,
                                 num_leading_blocks_not_held: int = 0) -> Reservation: ...

    async def commit_migrate_in(self, migration_id: str, state: RequestState, attempt: int = 0) -> None:
        """`attempt`: the frontend's attempt at the request here (request_copy), kept with its copy there."""

    async def abort_migrate_in(self, migration_id: str) -> bool: ...


class BlockTransferer(Protocol):
    """The co-located transfer service (services/transfer/client.py: TransferClient)."""

    async def transfer(self, transfer: BlockTransfer, timeout_s: float,
                       request_id: str | None = None) -> TransferResult: ...

