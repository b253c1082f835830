"""prefix_chunk_keys: chained, full chunks only, bounded, the same in every process."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from services.common.prefix_hash import DISPATCH_CHUNK_TOKENS, MAX_PREFIX_CHUNKS, prefix_chunk_keys

pytestmark = pytest.mark.timeout(30)
CHUNK = DISPATCH_CHUNK_TOKENS
PROMPT = tuple(range(100, 100 + 5 * CHUNK))
ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_one_key_per_full_chunk_as_uint64():
    keys = prefix_chunk_keys(PROMPT, MAX_PREFIX_CHUNKS)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert all(isinstance(k, int) and 0 <= k < 2**64 for k in keys)


def test_a_shared_prefix_gives_the_same_leading_keys():
    other = PROMPT[:3 * CHUNK] + tuple(range(9000, 9000 + 2 * CHUNK))
    assert prefix_chunk_keys(other, 8)[:3] == prefix_chunk_keys(PROMPT, 8)[:3]


@pytest.mark.parametrize("chunk", [0, 2, 4])
def test_a_difference_in_chunk_k_changes_keys_k_onwards_only(chunk):
    changed = list(PROMPT)
    changed[chunk * CHUNK + 7] += 1
    before, after = prefix_chunk_keys(PROMPT, 8), prefix_chunk_keys(changed, 8)
    assert after[:chunk] == before[:chunk]
    assert all(a != b for a, b in zip(after[chunk:], before[chunk:], strict=True))


def test_the_partial_last_chunk_is_not_hashed():
    assert prefix_chunk_keys(PROMPT + (1, 2, 3), 8) == prefix_chunk_keys(PROMPT, 8)
    assert prefix_chunk_keys(PROMPT[:CHUNK - 1], 8) == []


def test_max_chunks_is_respected():
    assert prefix_chunk_keys(PROMPT, 2) == prefix_chunk_keys(PROMPT, 8)[:2]
    assert prefix_chunk_keys(PROMPT, 0) == []
    assert len(prefix_chunk_keys(range((MAX_PREFIX_CHUNKS + 3) * CHUNK), MAX_PREFIX_CHUNKS)) == MAX_PREFIX_CHUNKS


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_keys_do_not_depend_on_the_process_or_its_hash_seed(hash_seed):
    code = ("from services.common.prefix_hash import prefix_chunk_keys; "
            f"print(prefix_chunk_keys(range(100, {100 + 5 * CHUNK}), 8))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": hash_seed},
                         capture_output=True, text=True, timeout=20, check=True).stdout
    assert out.strip() == str(prefix_chunk_keys(PROMPT, 8))


def test_keys_are_pinned():
    # Frontends and managers of different builds must agree: changing the hash is a wire change.
    assert prefix_chunk_keys(range(2 * CHUNK), 2) == [12005933293277482011, 11894147549972251683]


def test_a_cache_salt_changes_every_key_and_each_salt_is_its_own():
    plain, salted = prefix_chunk_keys(PROMPT, 8), prefix_chunk_keys(PROMPT, 8, "tenant-a")
    assert not set(plain) & set(salted)
    assert prefix_chunk_keys(PROMPT, 8, "tenant-a") == salted != prefix_chunk_keys(PROMPT, 8, "tenant-b")
    assert prefix_chunk_keys(PROMPT, 8, "") == plain
