import pytest
import torch

from services.common.errors import Aborted
from services.transfer.block_copy import gather_chunk, staged_view
from services.transfer.checksum import ChecksumVerifier, block_checksums
from services.transfer.chunk_plan import ChunkPlan
from tests.unit.transfer.factories import random_kv, rows_of, tiny_geometry

pytestmark = pytest.mark.timeout(30)

IDS = (5, 0, 9)


def _stage_all(kv, plan, corrupt_chunk=None):
    buffer = torch.zeros(plan.max_chunk_bytes, dtype=torch.uint8)
    for chunk in plan.chunks():
        staged = gather_chunk(rows_of(kv), torch.tensor(IDS), chunk, staged_view(buffer, plan, chunk, kv.dtype))
        if chunk.index == corrupt_chunk:
            staged.view(torch.uint8).view(-1)[3] ^= 1  # one flipped bit
        yield chunk, staged


@pytest.mark.parametrize("staging_bytes", [4096, 128, 256])  # whole blocks; rows split 1 and 2 at a time
def test_checksums_chain_over_row_chunks(staging_bytes):
    geometry = tiny_geometry()
    kv = random_kv(geometry, seed=5)
    plan = ChunkPlan.for_staging(geometry, len(IDS), staging_bytes)
    verifier = ChecksumVerifier(plan, block_checksums(rows_of(kv), IDS))
    for chunk, staged in _stage_all(kv, plan):
        verifier.update(chunk, staged)


def test_a_flipped_bit_aborts():
    geometry = tiny_geometry()
    kv = random_kv(geometry, seed=6)
    plan = ChunkPlan.for_staging(geometry, len(IDS), 128)
    verifier = ChecksumVerifier(plan, block_checksums(rows_of(kv), IDS))
    with pytest.raises(Aborted, match="checksum mismatch"):
        for chunk, staged in _stage_all(kv, plan, corrupt_chunk=5):
            verifier.update(chunk, staged)


def test_checksums_differ_between_blocks_and_are_off_when_empty():
    geometry = tiny_geometry()
    kv = random_kv(geometry, seed=7)
    assert len(set(block_checksums(rows_of(kv), (0, 1, 2)))) == 3
    assert not ChecksumVerifier(ChunkPlan.for_staging(geometry, 1, 4096), ()).is_enabled
