"""Per-block KV checksums: the crc32 ferry uses (services/transfer/checksum.py) against a
vectorized weighted sum and the other digests at hand, on the same blocks in the same run.

For each geometry it fills a KV cache with random values and checksums --blocks random,
non-contiguous blocks of it (every layer's K and V, rows as the transfer service folds
them), each candidate once per round, --repeats rounds; it prints the median time, the
speed and the ratio to crc32. Candidates:

* `crc32`: zlib.crc32 chained over each block's rows, as `block_checksums` does (a cache on
  a GPU is gathered and copied to the host first, as there);
* `sum`: a weighted sum, mod 2**32, of each block's 32-bit words (word j of row r counts an
  odd weight of (r, j mod 32) times; column sums first, then 32 weights a row), in torch on
  the cache's device, so on a GPU only the sums cross to the host. A single flipped bit always
  changes it (an odd weight times 2**b is not 0 mod 2**32), and chunks of rows fold in by
  addition; several changed words can cancel (two flips of bit 31), which a crc32 catches;
* `adler32`, `sha1`, `blake2b`: the same chaining as crc32 with zlib.adler32 and hashlib (the
  digests the standard library offers; no other hash library is installed).

Geometries: SmolLM2-135M (30 layers, 3 KV heads, head dim 64, 16-token blocks, float32 as
on the CPU: 720 KiB a block) and Llama-2-7B (32 layers, 32 KV heads, head dim 128, 16-token
blocks, float16: 8 MiB a block).

    PYTHONPATH=. .venv/bin/python benchmarks/block_checksum.py --threads 1

Prints (MiB = 2**20 bytes, GB/s = 1e9 bytes per second):
    geometry  blocks  MiB  candidate  ms  GB/s  x_crc32
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import pathlib
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere, as the README shows
from benchmarks.flags import HelpFormatter, at_least, names_of  # noqa: E402
from services.transfer.block_copy import as_bytes, kv_rows  # noqa: E402
from services.transfer.checksum import block_checksums  # noqa: E402

PERIOD_WORDS = 32


@dataclass(frozen=True, slots=True)
class Geometry:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


GEOMETRIES = {
    "smollm2": Geometry("smollm2", 30, 3, 64, 16, torch.float32),
    "llama7b": Geometry("llama7b", 32, 32, 128, 16, torch.float16),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--blocks", type=at_least(1), default=64, help="blocks checksummed per call")
    parser.add_argument("--spare-blocks", type=at_least(0), default=16,
                        help="blocks in the cache beside those, so the ones checksummed are not all adjacent")
    parser.add_argument("--repeats", type=at_least(1), default=5, help="rounds; every candidate runs once a round")
    parser.add_argument("--threads", type=at_least(1), default=1,
                        help="torch intra-op threads (an instance's --num-threads; the other candidates use one)")
    parser.add_argument("--device", default="cpu", help="where the cache lives: cpu, or cuda for a GPU's")
    parser.add_argument("--geometries", type=names_of(GEOMETRIES), default=",".join(GEOMETRIES),
                        help=f"comma-separated, of {', '.join(GEOMETRIES)}")
    parser.add_argument("--candidates", default="crc32,sum,adler32,sha1,blake2b",
                        help="comma-separated, of crc32, sum, adler32, sha1, blake2b")
    parser.add_argument("--seed", type=int, default=0, help="for the cache's values and the block ids")
    return parser.parse_args()


def chained(update: Callable[[memoryview, object], object], start: Callable[[], object]):
    """A checksum over each block's rows in order, the way the transfer service folds them."""
    def checksums(rows: torch.Tensor, block_ids: tuple[int, ...]) -> list:
        if rows.device.type != "cpu":  # a GPU cache: gathered and copied to the host first
            rows = rows.index_select(1, torch.tensor(block_ids, device=rows.device)).cpu()
            block_ids = tuple(range(len(block_ids)))
        data = as_bytes(rows)
        out = []
        for block_id in block_ids:
            state = start()
            for row in data[:, block_id]:
                state = update(row, state)
            out.append(state)
        return out
    return checksums


def _hashlib_update(row, h):
    h.update(row)
    return h


def weighted_sums(rows: torch.Tensor, block_ids: tuple[int, ...]) -> list[int]:
    """The `sum` candidate: Σ weights[r, j % 32] * word[r, j] (mod 2**32) over each block's int32 words."""
    words = rows.view(torch.uint8).view(torch.int32)  # both geometries' rows are a multiple of 128 bytes
    num_rows, _, num_words = words.shape
    columns = torch.empty(len(block_ids), num_rows, PERIOD_WORDS, dtype=torch.int32, device=words.device)
    for i, block_id in enumerate(block_ids):
        per_column = words[:, block_id].reshape(num_rows, num_words // PERIOD_WORDS, PERIOD_WORDS)
        torch.sum(per_column, 1, dtype=torch.int32, out=columns[i])
    sums = (columns * _weights(num_rows, words.device)).sum((1, 2), dtype=torch.int32)
    return [s & 0xFFFFFFFF for s in sums.tolist()]  # one copy to the host


@functools.cache
def _weights(num_rows: int, device: torch.device) -> torch.Tensor:
    """Odd int32 weights: a Weyl sequence over (row, column), bit 0 set."""
    index = torch.arange(num_rows * PERIOD_WORDS, dtype=torch.int64).view(num_rows, PERIOD_WORDS)
    unsigned = (index * 0x9E3779B9 + 0x7F4A7C15) % 2**32 | 1
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32).to(device)


CANDIDATES = {
    "crc32": block_checksums,
    "sum": weighted_sums,
    "adler32": chained(zlib.adler32, lambda: 1),
    "sha1": chained(_hashlib_update, hashlib.sha1),
    "blake2b": chained(_hashlib_update, hashlib.blake2b),
}


def measure(rows: torch.Tensor, block_ids: tuple[int, ...], names: list[str], repeats: int) -> dict[str, float]:
    """Median seconds of each candidate, rounds interleaved so load changes hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            if rows.device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            CANDIDATES[name](rows, block_ids)  # returns host ints: waits for the device
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = args.candidates.split(",")
    rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    print("geometry\tblocks\tMiB\tcandidate\tms\tGB/s\tx_crc32")
    for geometry in (GEOMETRIES[g] for g in args.geometries.split(",")):
        num_blocks = args.blocks + args.spare_blocks
        kv = torch.randn(geometry.shape(num_blocks), generator=generator).to(geometry.dtype).to(args.device)
        rows = kv_rows(kv)
        block_ids = tuple(rng.sample(range(num_blocks), args.blocks))
        num_bytes = rows[:, 0].numel() * rows.element_size() * len(block_ids)
        seconds = measure(rows, block_ids, names, args.repeats)
        base = seconds.get("crc32")
        for name, s in seconds.items():
            ratio = f"{base / s:.2f}" if base else "-"
            print(f"{geometry.name}\t{len(block_ids)}\t{num_bytes / 2**20:.0f}\t{name}\t{s * 1e3:.1f}\t"
                  f"{num_bytes / s / 1e9:.2f}\t{ratio}", flush=True)
        del kv, rows


if __name__ == "__main__":
    main()
