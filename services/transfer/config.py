"""Configuration of one transfer service process (`python -m services.transfer`)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check_positive, knob
from services.common.errors import FailedPrecondition
from services.common.etcd_client import EtcdKnobs, EtcdStartupKnobs
from services.common.etcd_endpoints import check_grpc_host_flags, check_host_flags
from services.common.ids import check_id_flag
from services.common.heap import DEFAULT_KEEP_MIB
from services.common.logging import LogKnobs
from services.common.tls import TlsKnobs
from services.transfer.chunk_plan import IN_PLACE_MIN_ROW_BYTES
from services.transfer.domain import CHANNEL_BACKENDS, DEFAULT_PIECE_BYTES, TransferBackend
from services.transfer.pair_channel import MAX_GLOO_CONNECTIONS, TAG_STRIDE, check_backend_available


@dataclass(frozen=True, slots=True)
class TransferConfig(EtcdKnobs, EtcdStartupKnobs, TlsKnobs, LogKnobs):
    """Moves KV cache blocks between instances' KV memory (ferry.v1.TransferService)."""

    transfer_id: str = knob("", "unique id of this transfer service in the cluster (default: <host>-<port>)")
    host: str = knob("127.0.0.1", "address to bind the gRPC server (and gloo/nccl channels) to")
    port: int = knob(0, "gRPC port (0 = pick a free one)")
    advertise_host: str = knob("", "host other processes use to reach this service (default: --host)")
    etcd_endpoints: list[str] = knob([], "etcd endpoints host:port (comma-separated); empty = run without registering")
    cluster: str = knob("ferry", "cluster name: etcd keys live under /ferry/<cluster>/")
    lease_ttl_s: float = knob(5.0, "etcd lease TTL in seconds")
    backends: list[TransferBackend] = knob(
        [TransferBackend.GRPC, TransferBackend.GLOO, TransferBackend.SHM],
        "backends this service sends with, comma-separated (add nccl on CUDA hosts); it receives whatever a peer "
        "sends (grpc always, gloo/nccl where this host runs them): the sender picks the backend")
    default_backend: TransferBackend = knob(TransferBackend.GRPC, "backend for Transfer calls that name none")
    map_instances: list[str] = knob([], "instance ids to map at startup, read from their etcd records "
                                        "(kv_shm_name, kv); needs --etcd-endpoints")
    staging_kib: int = knob(16384, "size of each staging buffer in KiB; transfers move chunks of at most this size")
    staging_buffers: int = knob(4, "staging buffers each transfer holds (2..64): one is gathered or scattered "
                                   "while gloo moves up to the others at once")
    num_staging_slots: int = knob(2, "transfers in flight at once per direction (this many sending and this many "
                                     "receiving), each holding --staging-buffers buffers")
    gloo_connections: int = knob(4, "TCP connections in each gloo channel this service opens (1..16); chunks "
                                    "in flight take them in turn")
    in_place_min_kib: int = knob(
        IN_PLACE_MIN_ROW_BYTES >> 10,
        "gloo: blocks with consecutive ids travel row by row, sent straight from the source's KV memory and "
        "received straight into the destination's (no gather or scatter on a side where they are consecutive), "
        "when one row of them is at least this many KiB; for shorter runs gloo's cost per message and the "
        "staged chunks drained before each run outweigh the copies saved (0 = never)")
    grpc_piece_kib: int = knob(
        DEFAULT_PIECE_BYTES >> 10,
        "most data bytes per ReceiveBlocks message of the grpc backend, in KiB: senders cut grpc transfers into "
        "chunks of this size (or --staging-kib if smaller), one message each")
    heap_keep_mib: int = knob(
        DEFAULT_KEEP_MIB,
        "freed heap memory this process keeps mapped for reuse, in MiB (glibc): grpc messages are then not "
        "written into fresh pages each time (faulting them in costs as much as the copy); 0 = the C library's "
        "defaults")
    nccl_device: int = knob(0, "CUDA device index this service's nccl channels run on (NCCL refuses two ranks on one "
                               "GPU: give the two ends of a pair on one host different GPUs)")
    transfer_timeout_s: float = knob(60.0, "upper bound of one transfer (the caller's deadline applies if shorter)")
    channel_timeout_s: float = knob(10.0, "gloo/nccl rendezvous timeout in seconds")
    num_threads: int = knob(0, "torch threads for gathers, scatters and same-host copies (0 = torch's default: one per core)")
    metrics_port: int = knob(0, "port of the Prometheus /metrics endpoint (0 = off)")
    metrics_host: str = knob("", "address to bind the Prometheus /metrics endpoint to (default: --host, as the gRPC "
                                 "server; e.g. 0.0.0.0 for a Prometheus on another machine, gRPC left on 127.0.0.1)")

    def __post_init__(self) -> None:
        check_id_flag("--transfer-id", self.transfer_id)
        self.check_etcd_flags(self.cluster, self.etcd_endpoints)
        check_host_flags(self, ("host", "advertise_host", "metrics_host"))
        check_grpc_host_flags(self, ("host", "advertise_host"))
        self.tls.check()
        self.etcd_access.check()
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s must be at least 1 (etcd leases are whole seconds), got {self.lease_ttl_s}")
        check_positive(self, ("transfer_timeout_s", "channel_timeout_s"))
        if self.num_threads < 0:
            raise ValueError(f"--num-threads must be >= 0 (0 = torch's default), got {self.num_threads}")
        if not self.backends:
            raise ValueError("--backends must name at least one of grpc, gloo, nccl, shm")
        if self.default_backend not in self.backends:
            raise ValueError(f"--default-backend {self.default_backend.value} is not in --backends "
                             f"{','.join(b.value for b in self.backends)}")
        if self.in_place_min_kib < 0:
            raise ValueError(f"--in-place-min-kib must be 0 (never) or positive, got {self.in_place_min_kib}")
        check_positive(self, ("staging_kib", "num_staging_slots", "grpc_piece_kib"))
        if not 0 <= self.heap_keep_mib < 2048:
            raise ValueError(f"--heap-keep-mib must be 0..2047, got {self.heap_keep_mib}")
        if not 2 <= self.staging_buffers <= TAG_STRIDE:
            raise ValueError(f"--staging-buffers must be 2..{TAG_STRIDE}, got {self.staging_buffers}")
        if not 1 <= self.gloo_connections <= MAX_GLOO_CONNECTIONS:
            raise ValueError(f"--gloo-connections must be 1..{MAX_GLOO_CONNECTIONS}, got {self.gloo_connections}")
        if self.grpc_piece_kib * 1024 > 60 * 2**20:
            raise ValueError("--grpc-piece-kib must stay under the 64 MiB gRPC message limit")
        if self.nccl_device < 0:
            raise ValueError(f"--nccl-device must be a CUDA device index >= 0, got {self.nccl_device}")
        self._check_backends_usable()
        if self.map_instances and not self.etcd_endpoints:
            raise ValueError("--map-instances reads instance records from etcd; set --etcd-endpoints")

    def _check_backends_usable(self) -> None:
        """Refuse at startup what every transfer would refuse: nccl without CUDA (or --nccl-device past
        the visible GPUs), gloo without a torch that has it."""
        for backend in self.backends:
            if backend in CHANNEL_BACKENDS:
                try:
                    check_backend_available(backend, self.nccl_device)
                except FailedPrecondition as exc:
                    raise ValueError(f"--backends {backend.value}: {exc.message}") from None
