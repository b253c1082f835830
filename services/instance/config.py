"""Configuration of one instance process (`python -m services.instance`)."""

import enum
import pathlib
from dataclasses import dataclass

from services.common.config import check_non_negative, check_positive, knob
from services.common.etcd_client import EtcdKnobs, EtcdStartupKnobs
from services.common.etcd_endpoints import check_address_flag, check_grpc_host_flags, check_host_flags
from services.common.ids import check_id_flag
from services.common.logging import LogKnobs
from services.common.tls import TlsKnobs
from services.instance.engine.device import resolve_device
from services.instance.engine.scheduler import prefill_chunk_size
from services.transfer.domain import TransferBackend


class InstanceRole(enum.Enum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class PdHandoff(enum.Enum):
    """Who moves a prefill instance's request to a decode instance once it has its first token."""

    PUSH = "push"  # this instance, at once: asks the manager for a decode instance, migrates, reports
    MANAGER = "manager"  # the manager's migration loop, on its next tick (the healing path in both modes)


class BackendChoice(enum.Enum):
    """--transfer-backend: one transfer backend for every migration, or AUTO: shm where this
    instance's own transfer service maps the destination's KV memory too (both on this host)
    and offers shm, grpc otherwise (the first of gloo and nccl it offers, when it offers no grpc)."""

    AUTO = "auto"
    GRPC = "grpc"
    GLOO = "gloo"
    NCCL = "nccl"
    SHM = "shm"

    @property
    def backend(self) -> TransferBackend | None:
        """The fixed backend, or None for AUTO (chosen per migration)."""
        return None if self is BackendChoice.AUTO else TransferBackend(self.value)


class EngineKind(enum.Enum):
    TORCH = "torch"  # the model's forward pass in PyTorch
    SIM = "sim"  # the same engine with a latency model instead of the forward pass (no weights)


CPU_STEP_TOKENS = 512  # --max-num-batched-tokens 0 on the CPU: a chunk of this many tokens takes about a second
GPU_STEP_TOKENS = 2048  # ... and on a GPU


@dataclass(frozen=True, slots=True)
class InstanceConfig(EtcdKnobs, EtcdStartupKnobs, TlsKnobs, LogKnobs):
    """One inference engine with a paged KV cache, served over gRPC (ferry.v1.InstanceService)."""

    model: pathlib.Path = knob(pathlib.Path("models/smollm2-135m-instruct"), "Hugging Face model folder (config.json, *.safetensors or pytorch_model*.bin, tokenizer.json)")
    instance_id: str = knob("", "unique id of this instance in the cluster (default: <host>-<port>)")
    host: str = knob("127.0.0.1", "address to bind the gRPC server to")
    port: int = knob(0, "gRPC port (0 = pick a free one)")
    advertise_host: str = knob("", "host other processes use to reach this instance (default: --host)")
    role: InstanceRole = knob(InstanceRole.BOTH, "what the instance serves in prefill/decode disaggregation")
    pd_handoff: PdHandoff = knob(PdHandoff.PUSH, "who moves a request from a prefill instance to a decode instance "
                                                 "after its first token: push (this instance, at once) or manager "
                                                 "(the manager's migration loop, next tick)")
    pd_handoff_hold_s: float = knob(1.0, "prefill role, push hand-off: a prefilled request parked this long in "
                                         "the hand-off queue (a burst, or a hand-off stuck on a frozen decode "
                                         "instance) decodes here until a worker takes it, so its client's pause "
                                         "between first and second token stays about this long. Also the deadline of a "
                                         "hand-off's first PrepareMigrateIn (the parked request waits on it): a "
                                         "decode instance slower to answer leaves the request decoding here")
    engine: EngineKind = knob(EngineKind.TORCH, "inference engine: torch (runs the model) or sim (scheduler, KV "
                                                "cache and migration as torch, a latency model instead of the "
                                                "forward pass: many instances on one machine)")
    sim_step_ms: float = knob(8.0, "sim engine: milliseconds every step takes")
    sim_prefill_ms_per_token: float = knob(0.06, "sim engine: milliseconds each prompt token adds to its step")
    sim_decode_ms_per_seq: float = knob(0.08, "sim engine: milliseconds each decoding sequence adds to its step")
    etcd_endpoints: list[str] = knob([], "etcd endpoints host:port (comma-separated); empty = run without registering")
    cluster: str = knob("ferry", "cluster name: etcd keys live under /ferry/<cluster>/")
    lease_ttl_s: float = knob(5.0, "etcd lease TTL in seconds; the instance re-registers if it loses its lease")
    dtype: str = knob("float32", "weights and KV cache dtype: float32, bfloat16 or float16")
    device: str = knob("cpu", "where the torch engine keeps its weights and KV cache: cpu, cuda or cuda:N (on a GPU "
                              "the transfer service maps the KV cache through a CUDA IPC handle)")
    block_size: int = knob(16, "tokens per KV cache block")
    num_blocks: int = knob(0, "KV cache blocks (0 = size from --kv-cache-mib)")
    kv_cache_mib: int = knob(512, "KV cache size in MiB when --num-blocks is 0")
    max_num_seqs: int = knob(64, "most requests running in one batch")
    max_waiting_requests: int = knob(1024, "new requests queued for a batch slot beyond which Generate is refused "
                                           "with RESOURCE_EXHAUSTED (a 429 from the frontend); 0 = no bound")
    max_num_batched_tokens: int = knob(0, "most tokens (prefill chunks + decodes) in one engine step: the decoding "
                                          "requests beside a long prompt wait one chunk per step (0 = 512 on the "
                                          "CPU, 2048 on a GPU)")
    prefill_chunk_tokens: int = knob(0, "a long prompt is prefilled in chunks that end at multiples of this, the same "
                                        "places whatever the load, so its bits do not depend on the batch; at most "
                                        "--max-num-batched-tokens less --max-num-seqs (0 = half of that in whole "
                                        "blocks: two prefills share a step, so a short prompt arriving while a long "
                                        "one prefills starts at once)")
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of prompt prefixes earlier requests computed "
                                             "(full blocks, matched by a hash of their tokens); false = off")
    priority_headroom_blocks: int = knob(0, "KV blocks each running or queued request with priority > 0 keeps "
                                            "out of this instance's reported freeness (Llumnix's priority headroom): "
                                            "the manager then dispatches fewer requests here and migrates others "
                                            "away, so high-priority requests decode with less company (0 = off)")
    max_model_len: int = knob(0, "longest sequence (prompt + output) in tokens (0 = the longest the model serves: max_position_embeddings, or less for longrope RoPE)")
    num_threads: int = knob(0, "torch threads for the engine (0 = torch's default)")
    load_report_interval_s: float = knob(0.075, "seconds between load reports streamed to the leader manager")
    shutdown_grace_s: float = knob(5.0, "seconds running requests get to finish on SIGTERM before they are cut")
    engine_stall_timeout_s: float = knob(120.0, "an engine step running longer than this (a hung accelerator, a "
                                                "deadlock) takes the instance out of service until it returns: its "
                                                "streams end UNAVAILABLE so frontends resume them elsewhere; set it "
                                                "well above the longest step; 0 = never")
    transfer_address: str = knob("", "host:port of the co-located transfer service, which maps this instance's KV "
                                     "memory at startup; empty = live migration off")
    transfer_backend: BackendChoice = knob(BackendChoice.AUTO, "how KV blocks travel when a migration names no "
                                                               "backend: auto (shm when this instance's transfer "
                                                               "service also maps the destination, i.e. the same "
                                                               "host, and offers shm; grpc otherwise, or the first "
                                                               "of gloo and nccl it offers when it offers no grpc), "
                                                               "grpc, gloo, nccl or shm")
    migration_stage_blocks: int = knob(16, "live migration stops the request and copies the rest once at most this "
                                           "many of its blocks are left to copy")
    migration_max_stages: int = knob(3, "live copy stages (while the request decodes) before the final stop-and-copy")
    max_concurrent_migrations: int = knob(1, "migrations in or out this instance runs at once")
    migration_reservation_timeout_s: float = knob(30.0, "seconds a migration's reserved blocks wait without a "
                                                        "call from the source (or a migrated-in request for its "
                                                        "client to attach) before they are freed")
    migration_rpc_timeout_s: float = knob(5.0, "deadline of each Prepare/Commit/AbortMigrateIn call to a destination")
    migration_transfer_timeout_s: float = knob(20.0, "deadline of each migration stage's block copy (it and "
                                                     "--migration-rpc-timeout-s must sum to less than "
                                                     "--migration-reservation-timeout-s)")
    verify_transfer_checksum: bool = knob(False, "check a crc32 of every migrated KV block at the destination")
    metrics_port: int = knob(0, "port of the Prometheus /metrics endpoint (0 = off)")
    metrics_host: str = knob("", "address to bind the Prometheus /metrics endpoint to (default: --host, as the gRPC "
                                 "server; e.g. 0.0.0.0 for a Prometheus on another machine, gRPC left on 127.0.0.1)")

    @property
    def step_token_budget(self) -> int:
        """--max-num-batched-tokens, or the device's default: on a CPU a 2048-token chunk takes
        seconds, and every stream decoding beside a long prompt would stall that long each step."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return CPU_STEP_TOKENS if self.device == "cpu" else GPU_STEP_TOKENS

    def __post_init__(self) -> None:
        check_id_flag("--instance-id", self.instance_id)
        self.check_etcd_flags(self.cluster, self.etcd_endpoints)
        check_host_flags(self, ("host", "advertise_host", "metrics_host"))
        check_grpc_host_flags(self, ("host", "advertise_host"))
        self.tls.check()
        self.etcd_access.check()
        check_address_flag("--transfer-address", [self.transfer_address] if self.transfer_address else [])
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s must be at least 1 (etcd leases are whole seconds), got {self.lease_ttl_s}")
        check_non_negative(self, ("num_threads", "shutdown_grace_s", "priority_headroom_blocks", "max_model_len"))
        if self.load_report_interval_s <= 0:
            raise ValueError(f"--load-report-interval-s must be positive, got {self.load_report_interval_s}")
        if self.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        check_non_negative(self, ("sim_step_ms", "sim_prefill_ms_per_token", "sim_decode_ms_per_seq",
                                  "engine_stall_timeout_s"))
        if self.num_blocks < 0:
            raise ValueError(f"--num-blocks must be >= 0 (0 = size from --kv-cache-mib), got {self.num_blocks}")
        if self.num_blocks == 0 and self.kv_cache_mib <= 0:
            raise ValueError(f"--kv-cache-mib must be positive, got {self.kv_cache_mib}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0 (0 = no bound), got {self.max_waiting_requests}")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"--max-num-batched-tokens must be positive (or 0 for the device's default), "
                             f"got {self.max_num_batched_tokens}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"--prefill-chunk-tokens must be >= 0 (0 = the default), got {self.prefill_chunk_tokens}")
        prefill_chunk_size(self.step_token_budget, self.max_num_seqs, self.block_size, self.prefill_chunk_tokens)
        check_non_negative(self, ("migration_stage_blocks", "migration_max_stages"))  # 0 stages = stop-and-copy
        check_positive(self, ("max_concurrent_migrations", "migration_reservation_timeout_s", "migration_rpc_timeout_s",
                              "migration_transfer_timeout_s", "pd_handoff_hold_s"))
        if self.migration_reservation_timeout_s <= self.migration_transfer_timeout_s + self.migration_rpc_timeout_s:
            raise ValueError(f"--migration-reservation-timeout-s ({self.migration_reservation_timeout_s:g}) must exceed "
                             f"--migration-transfer-timeout-s ({self.migration_transfer_timeout_s:g}) + "
                             f"--migration-rpc-timeout-s ({self.migration_rpc_timeout_s:g}): a destination reservation "
                             "that expires while its stage's copy, or the commit after it, may still run fails a "
                             "healthy, slow migration")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if resolve_device(self.device).type != "cpu" and self.engine is EngineKind.SIM:
            raise ValueError("--device: the sim engine runs no model and keeps its KV cache on the host; use --device cpu")
