"""benchmarks/block_checksum.py runs and prints each candidate's time, speed and ratio to crc32."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.unit.benchmarks.loading import ROOT, load_benchmark

pytestmark = pytest.mark.timeout(120)


def test_it_prints_every_candidate_with_its_ratio_to_crc32():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "block_checksum.py"), "--blocks", "2", "--spare-blocks", "1",
         "--repeats", "1", "--geometries", "smollm2"],
        capture_output=True, text=True, timeout=100, check=True).stdout
    header, *rows = [line.split("\t") for line in out.splitlines()]
    assert header == ["geometry", "blocks", "MiB", "candidate", "ms", "GB/s", "x_crc32"]
    assert [row[3] for row in rows] == ["crc32", "sum", "adler32", "sha1", "blake2b"]
    assert all(row[:3] == ["smollm2", "2", "1"] for row in rows)
    assert dict((row[3], row[6]) for row in rows)["crc32"] == "1.00"


def test_the_sum_candidate_is_the_weighted_sum_it_says_and_sees_every_flipped_bit(monkeypatch):
    bench = load_benchmark(ROOT / "benchmarks" / "block_checksum.py", monkeypatch)
    rows = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(1))  # 3 rows of 4 blocks, 256 bytes a row
    words = rows.view(torch.int32)

    def weight(row: int, column: int) -> int:
        return ((row * 32 + column) * 0x9E3779B9 + 0x7F4A7C15) % 2**32 | 1

    expected = [sum(weight(r, j % 32) * int(words[r, b, j]) for r in range(3) for j in range(64)) % 2**32
                for b in (2, 0)]
    assert bench.weighted_sums(rows, (2, 0)) == expected
    for bit in range(3 * 256 * 8):
        flipped = rows.clone()
        flipped[bit // 2048, 2].view(torch.uint8)[bit % 2048 // 8] ^= 1 << bit % 8
        assert bench.weighted_sums(flipped, (2,)) != expected[:1], bit
