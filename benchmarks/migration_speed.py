"""KV migration speed between two real transfer services on loopback, per backend.

Llama-2-7B KV geometry (32 layers, 32 KV heads, head dim 128, fp16, 16-token blocks =
8 MiB a block). For each size (8 MB doubling up to --max-mb) it moves a random,
non-contiguous set of blocks from instance A's KV memory to random blocks of instance
B's, through service A's Transfer RPC, and reports the median speed over --repeats.
The `*_contiguous_speed` rows move consecutive blocks to consecutive blocks instead, as
a sequence's blocks usually lie (the block manager hands out the lowest free ids): gloo
then moves them without gather or scatter.
Reference figures measured in the same run, at the same sizes: a raw TCP socket
between two processes (preallocated buffers, sendall/recv_into), bare gloo between two
processes (torch.distributed send/recv of preallocated buffers in chunks of the services'
staging size, over as many connections and with as many chunks in flight as the services
use: gloo's own ceiling, with no gather, scatter or RPC), a bare grpc-python
stream between two processes (one bytes message per grpc chunk, the same channel options,
received and dropped: grpc's own ceiling) and one memcpy.
Figures are steady state: every row first moves the largest size once, untimed
(--settle-passes), and each timed transfer follows an untimed one of the same row and
size (--warmups).

    PYTHONPATH=. .venv/bin/python benchmarks/migration_speed.py --max-mb 256

Prints (tab-separated; MB = 2**20 bytes, GB/s = 1e9 bytes per second):
    migration_size  8.00 MB  16.00 MB ...
    grpc_speed(GB/s) ...
and writes results.tsv and migration_speed.png to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid

import torch
from tqdm import tqdm

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere, as the README shows
from services.cluster.processes import ServiceProcess, stop_all  # noqa: E402
from services.common.etcd_launcher import free_port  # noqa: E402
from services.common.heap import DEFAULT_KEEP_MIB, keep_freed_heap  # noqa: E402
from services.instance.engine.kv_cache import KvCache, KvGeometry  # noqa: E402
from services.transfer.chunk_plan import IN_PLACE_MIN_ROW_BYTES  # noqa: E402
from services.transfer.client import DEFAULT_PIECE_BYTES, TransferClient  # noqa: E402
from services.transfer.domain import BlockTransfer, InstanceId, TransferBackend  # noqa: E402
from benchmarks.stopping import as_ctrl_c, logs_kept_on_failure, raise_if_stopping  # noqa: E402
from benchmarks.flags import HelpFormatter  # noqa: E402
from benchmarks.speed_references import (  # noqa: E402
    GlooReference, GrpcReference, MemcpyReference, References, TcpReference)

MB = 2**20
LLAMA2_7B = dict(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype=torch.float16)
BACKENDS = (TransferBackend.GRPC, TransferBackend.GLOO, TransferBackend.SHM)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--max-mb", type=int, default=512, help="largest migration size in MB (sizes double from 8)")
    parser.add_argument("--repeats", type=int, default=5, help="transfers per size and backend (the median counts)")
    parser.add_argument("--backends", default="grpc,gloo,shm", help="comma-separated transfer backends to measure")
    parser.add_argument("--layouts", default="scattered,contiguous",
                        help="comma-separated block layouts: scattered (random ids on both sides: rows "
                             "<backend>_speed) and contiguous (consecutive ids: rows <backend>_contiguous_speed)")
    parser.add_argument("--warmups", type=int, default=1,
                        help="untimed transfers of the same row and size right before each timed one, so each figure "
                             "is steady state (as nccl-tests time theirs); 0 times each transfer cold, right after "
                             "the other rows ran")
    parser.add_argument("--settle-passes", type=int, default=1,
                        help="untimed passes over every row at the largest size before timing starts, so no timed "
                             "transfer pays a first touch of KV, staging or reference memory (cold, the first "
                             "8 MB rows measured up to 2x slower); 0 times from a cold start")
    parser.add_argument("--staging-kib", type=int, default=16384, help="the services' --staging-kib")
    parser.add_argument("--staging-buffers", type=int, default=4,
                        help="the services' --staging-buffers (gloo keeps all but one chunk of them in flight)")
    parser.add_argument("--gloo-connections", type=int, default=4, help="the services' --gloo-connections")
    parser.add_argument("--grpc-piece-kib", type=int, default=DEFAULT_PIECE_BYTES >> 10,
                        help="the services' --grpc-piece-kib (data bytes per grpc message; the bare grpc reference "
                             "sends messages of this size too)")
    parser.add_argument("--in-place-min-kib", type=int, default=IN_PLACE_MIN_ROW_BYTES >> 10,
                        help="the services' --in-place-min-kib (gloo moves consecutive blocks in place when a row "
                             "of them is this long; 0 = never)")
    parser.add_argument("--heap-keep-mib", type=int, default=DEFAULT_KEEP_MIB,
                        help="the services' --heap-keep-mib (freed heap kept mapped, so grpc messages do not land on "
                             "fresh pages; 0 = glibc's defaults); the bare grpc reference's two processes get the same")
    parser.add_argument("--kv-device", default="cpu", choices=["cpu", "cuda"],
                        help="where the two KV caches live: cpu (shared memory) or cuda (GPU memory the services "
                             "map through CUDA IPC; with two GPUs the destination's cache and the second service's "
                             "nccl channels go on the second one, so --backends may include nccl)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("bench-results"),
                        help="where the TSV and PNG are written")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scattered block ids")
    args = parser.parse_args()
    if problem := flag_problem(args):
        parser.error(problem)
    return args


LAYOUTS = {"scattered": ("", False), "contiguous": ("_contiguous", True)}  # name → (row suffix, is_contiguous)


def flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, before any process starts (argparse then exits 2 with it), or None."""
    block_mb = KvGeometry(num_blocks=1, **LLAMA2_7B).bytes_per_block // MB
    known = [backend.value for backend in TransferBackend]
    backends, layouts = args.backends.split(","), args.layouts.split(",")
    if args.max_mb < block_mb:
        return f"--max-mb {args.max_mb}: the smallest migration is one {block_mb} MB block"
    if unknown := [name for name in backends if name not in known]:
        return f"--backends: unknown {','.join(unknown)} (of {','.join(known)})"
    if "nccl" in backends and args.kv_device != "cuda":
        return "--backends nccl needs --kv-device cuda"
    if unknown := [name for name in layouts if name not in LAYOUTS]:
        return f"--layouts: unknown {','.join(unknown)} (of {','.join(LAYOUTS)})"
    counts = {"--repeats": (args.repeats, 1), "--warmups": (args.warmups, 0), "--settle-passes": (args.settle_passes, 0),
              "--staging-kib": (args.staging_kib, 1), "--staging-buffers": (args.staging_buffers, 2),
              "--gloo-connections": (args.gloo_connections, 1), "--grpc-piece-kib": (args.grpc_piece_kib, 1),
              "--in-place-min-kib": (args.in_place_min_kib, 0), "--heap-keep-mib": (args.heap_keep_mib, 0)}
    for flag, (value, least) in counts.items():
        if value < least:
            return f"{flag} {value}: at least {least}"
    return None


def sizes_mb(max_mb: int, block_mb: int) -> list[int]:
    sizes, size = [], block_mb
    while size <= max_mb:
        sizes.append(size)
        size *= 2
    return sizes


# -- the transfer services -------------------------------------------------------------

class Bench:
    """Two transfer services (A sends, B receives) and two instances' KV caches in shared memory."""

    def __init__(self, num_blocks: int, service_flags: list[str], log_dir: pathlib.Path, kv_device: str = "cpu") -> None:
        self.geometry = KvGeometry(num_blocks=num_blocks, **LLAMA2_7B)
        tag = uuid.uuid4().hex[:6]
        src_device, dst_device = _kv_devices(kv_device)
        self.caches: list[KvCache] = []  # what close() unlinks, however far this got
        self.clients: list[TransferClient] = []
        try:
            self.src = self._cache(f"ferry-bench-src-{tag}", src_device)
            self.dst = self._cache(f"ferry-bench-dst-{tag}", dst_device)
            self.src.tensor.copy_(torch.randn(self.geometry.shape, dtype=torch.float16, device=src_device))  # faults pages in
            self.dst.tensor.fill_(0)
        except BaseException:  # no Bench to close: unlink here
            self._unlink_caches()
            raise
        nccl_devices = (src_device.index or 0, dst_device.index or 0)
        self.services = [_service(name, [*service_flags, "--nccl-device", str(nccl_device)], log_dir)
                         for name, nccl_device in zip(("bench-a", "bench-b"), nccl_devices)]

    def _cache(self, name: str, device: torch.device) -> KvCache:
        self.caches.append(KvCache.create(name, self.geometry, device))
        return self.caches[-1]

    async def start(self) -> None:
        for service in self.services:
            service.start()
        for service in self.services:
            await service.wait_healthy(60)
        self.a = TransferClient(self.services[0].address, timeout_s=30)
        self.b = TransferClient(self.services[1].address, timeout_s=30)
        self.clients = [self.a, self.b]
        await self.a.map_instance("src", self.src.name, self.geometry, self.src.ipc_handle)
        await self.a.map_instance("dst", self.dst.name, self.geometry, self.dst.ipc_handle)  # for SHM
        await self.b.map_instance("dst", self.dst.name, self.geometry, self.dst.ipc_handle)
        await asyncio.sleep(1.0)  # the services pre-fault the mappings in the background

    async def transfer_s(self, backend: TransferBackend, num_blocks: int, rng: random.Random,
                         is_contiguous: bool = False) -> float:
        if is_contiguous:
            src_ids, dst_ids = (_run(rng, self.geometry.num_blocks, num_blocks) for _ in range(2))
        else:
            src_ids = tuple(rng.sample(range(self.geometry.num_blocks), num_blocks))
            dst_ids = tuple(rng.sample(range(self.geometry.num_blocks), num_blocks))
        request = BlockTransfer(InstanceId("src"), src_ids, InstanceId("dst"), dst_ids, self.services[1].address,
                                backend, is_checksum_verified=False)
        started = time.perf_counter()
        await self.a.transfer(request, timeout_s=120)
        return time.perf_counter() - started

    async def close(self) -> None:
        """Everything start() got to, also after it failed half way."""
        try:
            for client in self.clients:
                await client.close()
        finally:
            stop_all(self.services)
            self._unlink_caches()

    def _unlink_caches(self) -> None:
        for cache in self.caches:
            cache.close()
            cache.unlink()
        self.caches = []


def _kv_devices(kv_device: str) -> tuple[torch.device, torch.device]:
    """(source, destination) cache devices: the host, or the first GPU and the second (else the first)."""
    if kv_device == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    return torch.device("cuda", 0), torch.device("cuda", 1 % torch.cuda.device_count())


def _run(rng: random.Random, num_cache_blocks: int, num_blocks: int) -> tuple[int, ...]:
    first = rng.randrange(num_cache_blocks - num_blocks + 1)
    return tuple(range(first, first + num_blocks))


def _service(name: str, flags: list[str], log_dir: pathlib.Path) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(name, "transfer", ["--port", str(port), "--transfer-id", name,
                                             *flags, "--log-level", "warning"], f"127.0.0.1:{port}", log_dir)


def service_flags(args: argparse.Namespace) -> list[str]:
    offered = "grpc,gloo,shm,nccl" if "nccl" in args.backends.split(",") else "grpc,gloo,shm"
    return ["--backends", offered, "--staging-kib", str(args.staging_kib), "--staging-buffers", str(args.staging_buffers),
            "--gloo-connections", str(args.gloo_connections), "--in-place-min-kib", str(args.in_place_min_kib),
            "--grpc-piece-kib", str(args.grpc_piece_kib), "--heap-keep-mib", str(args.heap_keep_mib)]


# -- the run --------------------------------------------------------------------------------

async def measure(args: argparse.Namespace, log_dir: pathlib.Path) -> tuple[list[int], dict[str, list[float]]]:
    backends = [TransferBackend(name) for name in args.backends.split(",")]
    block_mb = KvGeometry(num_blocks=1, **LLAMA2_7B).bytes_per_block // MB
    sizes = sizes_mb(args.max_mb, block_mb)
    num_blocks = sizes[-1] // block_mb
    rng = random.Random(args.seed)
    tcp, memcpy = TcpReference(sizes[-1] * MB), MemcpyReference(sizes[-1] * MB)
    gloo = (GlooReference(sizes[-1] * MB, args.staging_kib * 1024, args.gloo_connections, args.staging_buffers - 1)
            if TransferBackend.GLOO in backends else None)
    grpc_piece_bytes = min(args.grpc_piece_kib, args.staging_kib) * 1024  # the services' grpc chunk size
    keep_freed_heap(args.heap_keep_mib << 20)  # this process sends the bare grpc reference's stream
    bare_grpc = (GrpcReference(sizes[-1] * MB, grpc_piece_bytes, args.heap_keep_mib << 20)
                 if TransferBackend.GRPC in backends else None)
    bench = Bench(num_blocks, service_flags(args), log_dir, args.kv_device)  # the last: it owns shared memory
    speeds: dict[str, list[float]] = {}
    try:
        for reference in (tcp, gloo, bare_grpc):  # every process starts at once; each then waits for its own
            if reference is not None:
                reference.launch()
        await bench.start()
        tcp.connect()
        if gloo is not None:
            gloo.connect()
        if bare_grpc is not None:
            await bare_grpc.connect()
        for backend in backends:  # warm up: gloo rendezvous, connections, first-touch of staging
            await bench.transfer_s(backend, 1, rng)
        references = [("tcp_speed(GB/s)", "tcp"), ("memcpy_speed(GB/s)", "memcpy")]
        if gloo is not None:
            references.insert(1, ("gloo_raw_speed(GB/s)", "gloo_raw"))
        if bare_grpc is not None:
            references.insert(1, ("grpc_raw_speed(GB/s)", "grpc_raw"))
        rows = [(f"{b.value}{LAYOUTS[name][0]}_speed(GB/s)", (b, LAYOUTS[name][1]))
                for name in args.layouts.split(",") for b in backends] + references
        refs = References(tcp, gloo, bare_grpc, memcpy)
        progress = tqdm(total=len(rows) * (len(sizes) * args.repeats + args.settle_passes), desc="migration_speed",
                        unit="copy")
        for _ in range(args.settle_passes):
            for _label, what in rows:
                await _time_one(bench, refs, what, sizes[-1], block_mb, rng)
                progress.update()
        times: dict[tuple[str, int], list[float]] = {(label, size): [] for label, _ in rows for size in sizes}
        for size in sizes:  # interleaved, so a change in machine load hits every row alike
            for _ in range(args.repeats):
                for label, what in rows:
                    for _ in range(args.warmups):
                        await _time_one(bench, refs, what, size, block_mb, rng)
                    times[label, size].append(await _time_one(bench, refs, what, size, block_mb, rng))
                    progress.update()
        speeds = {label: [size * MB / statistics.median(times[label, size]) / 1e9 for size in sizes]
                  for label, _ in rows}
        progress.close()
    finally:
        try:
            tcp.close()
            if gloo is not None:
                gloo.close()
            if bare_grpc is not None:
                await bare_grpc.close()
        finally:
            await bench.close()  # the services and the shared memory, whatever a reference did
    return sizes, speeds


async def _time_one(bench: Bench, references: References, what, size: int, block_mb: int, rng: random.Random) -> float:
    raise_if_stopping()
    if what == "tcp":
        return references.tcp.send_s(size * MB)
    if what == "gloo_raw":
        return references.gloo.send_s(size * MB)
    if what == "grpc_raw":
        return await references.grpc.send_s(size * MB)
    if what == "memcpy":
        return references.memcpy.copy_s(size * MB)
    backend, is_contiguous = what
    return await bench.transfer_s(backend, size // block_mb, rng, is_contiguous)


def report(sizes: list[int], speeds: dict[str, list[float]], out_dir: pathlib.Path) -> str:
    lines = ["migration_size\t" + "\t".join(f"{size:.2f} MB" for size in sizes)]
    lines += [f"{label}\t" + "\t".join(f"{speed:.2f}" for speed in values) for label, values in speeds.items()]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.tsv").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def plot(sizes: list[int], speeds: dict[str, list[float]], out_dir: pathlib.Path) -> pathlib.Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    colors: dict[str, str] = {}  # a backend's scattered and contiguous rows share a color
    for label, values in speeds.items():
        name = label.replace("_speed(GB/s)", "")
        style = "--" if name in ("tcp", "memcpy", "gloo_raw", "grpc_raw") else ":" if "_contiguous" in name else "-"
        color = colors.setdefault(name.removesuffix("_contiguous"), f"C{len(colors)}")
        axes.plot(sizes, values, style, marker="o", color=color, label=name)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [f"{size}" for size in sizes])
    axes.set_xlabel("migration size (MB)")
    axes.set_ylabel("speed (GB/s)")
    axes.set_title("ferry KV migration speed (Llama-2-7B KV geometry, loopback)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    path = out_dir / "migration_speed.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, as_ctrl_c)  # timeout(1), kill: stop as Ctrl-C does, cleaning up
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="ferry-bench-"))  # the two services' logs
    with logs_kept_on_failure("migration_speed", log_dir, log_dir):
        sizes, speeds = asyncio.run(measure(args, log_dir))
    print(report(sizes, speeds, args.out_dir))
    print(f"plot: {plot(sizes, speeds, args.out_dir)}")


if __name__ == "__main__":
    main()
