"""The whole cluster with every instance on a GPU (`ferry up --device cuda`): KV caches in GPU
memory, lent to the transfer service through CUDA IPC. A request migrated mid-stream gets the
same token ids as the same request never migrated, and no block leaks. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from services.common.gen.ferry.v1 import manager_pb2
from tests.e2e.conftest import instances, launched_cluster, model_name, wait_for

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT, MAX_TOKENS = "A request that moves between two GPUs", 1000  # long: the migration must find it running


NCCL = pytest.param("nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                    reason="needs 2 CUDA devices (NCCL refuses two ranks on one GPU)"))


@pytest.fixture(scope="module", params=["auto", "grpc", NCCL])
def cluster(request, tiny_model_dir, tmp_path_factory):
    """auto: the one transfer service maps both GPU caches and copies between them directly;
    nccl: a transfer service per instance, each on its instance's GPU."""
    with launched_cluster(tiny_model_dir, tmp_path_factory.mktemp(f"cuda-{request.param}"), "--instances", "2",
                          "--device", "cuda", "--kv-cache-mib", "16", "--transfer-backend", request.param) as cluster:
        yield cluster | {"backend": request.param}


async def stream_tokens(client, cluster, admin=None) -> tuple[list[int], manager_pb2.MigrateResponse | None]:
    """Greedy token ids of PROMPT; with `admin`, migrated once 8 tokens in."""
    stream = await client.completions.create(model=model_name(cluster), prompt=PROMPT, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
    token_ids, moved = [], None
    async for chunk in stream:
        if chunk.choices:
            token_ids += chunk.choices[0].model_extra.get("token_ids") or []
            if admin is not None and moved is None and len(token_ids) >= 8:
                moved = await admin.Migrate(manager_pb2.MigrateRequest(request_id=chunk.id), timeout=60)
    return token_ids, moved


async def test_a_request_migrated_between_gpus_keeps_its_tokens_and_no_block_leaks(cluster, admin, client):
    await admin.SetPolicy(manager_pb2.Policy(dispatch="load", migration_enabled=False), timeout=5)
    infos = await wait_for(lambda: _reported(admin), 60, "both instances reporting")
    baseline = {i: info.num_free_blocks for i, info in infos.items()}
    never_migrated, _ = await stream_tokens(client, cluster)
    migrated, moved = await stream_tokens(client, cluster, admin)
    assert len(never_migrated) == MAX_TOKENS and migrated == never_migrated
    assert moved is not None and moved.src_instance_id != moved.dst_instance_id and moved.num_blocks > 0
    assert moved.backend == ("shm" if cluster["backend"] == "auto" else cluster["backend"])

    async def blocks_back():
        return {i: info.num_free_blocks for i, info in (await instances(admin)).items()} == baseline
    await wait_for(blocks_back, 30, f"free blocks back to {baseline}")


async def _reported(admin):
    infos = await instances(admin)
    return infos if len(infos) == 2 and all(info.report_age_s >= 0 for info in infos.values()) else None
