"""Prefill/decode disaggregation through the whole cluster: 1 prefill + 2 decode instances
started by `python -m services.cluster up --prefill-instances 1 --decode-instances 2`, driven
through the OpenAI API, checked through the admin API.

Every request is greedy with `ignore_eos`, so its token ids must equal what one local engine
produces, wherever it was prefilled and decoded. Tests run in file order on one cluster: the
SetRole test leaves instance-2 a prefill instance, and the kill test (last) kills instance-1,
the only decode instance left.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal

import llguidance
import pytest

from services.common.gen.ferry.v1 import common_pb2, manager_pb2
from services.instance.engine.tokenizer import Tokenizer
from tests.e2e.conftest import instances, launched_cluster, model_name, wait_for, pid_of

pytestmark = pytest.mark.timeout(300)

PREFILL, DECODE_1, DECODE_2 = "instance-0", "instance-1", "instance-2"
NUM_BATCH = 40  # ~10 s on 2 shared cores


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with launched_cluster(tiny_model_dir, tmp_path_factory.mktemp("pd"), "--prefill-instances", "1",
                          "--decode-instances", "2", "--kv-cache-mib", "16",
                          "--restart", "no") as cluster:  # a killed instance stays down: the cluster heals without it
        yield cluster


def mixed_batch(num: int, tag: str) -> tuple[list[str], list[int]]:
    """Prompts from 3 to ~120 words, outputs from 4 to 60 tokens."""
    prompts = [f"{tag} request {n} says " + " ".join(f"w{(n * 31 + i) % 97}" for i in range((n * 37) % 120))
               for n in range(num)]
    return prompts, [4 + (n * 13) % 57 for n in range(num)]


async def free_blocks(admin, alive: set[str]) -> dict[str, int]:
    async def reported():
        infos = await instances(admin)
        ok = all(i in infos and infos[i].report_age_s >= 0 and infos[i].num_running == 0 for i in alive)
        return {i: infos[i].num_free_blocks for i in alive} if ok else None
    return await wait_for(reported, 30, "every instance reporting, idle")


async def wait_blocks_back(admin, baseline: dict[str, int]) -> None:
    async def back():
        infos = await instances(admin)
        return {i: infos[i].num_free_blocks for i in baseline} == baseline
    await wait_for(back, 30, f"free blocks back to {baseline}")


async def complete(client, cluster, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    completion = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, extra_body={"return_token_ids": True,
                                                                            "ignore_eos": True})
    return completion.id, completion.choices[0].model_extra["token_ids"]


async def committed(admin, request_id: str) -> list[manager_pb2.MigrationRecord]:
    reply = await admin.ListMigrations(manager_pb2.ListMigrationsRequest(request_id=request_id), timeout=5)
    moves = [m for m in reply.migrations if m.outcome == "committed"]
    assert all(m.duration_ms >= m.downtime_ms for m in moves), moves  # a held request's wait counts in both
    return moves


async def set_role(admin, instance_id: str, role: int) -> None:
    reply = await admin.SetRole(manager_pb2.AdminSetRoleRequest(instance_id=instance_id, role=role), timeout=10)
    assert reply.role == role

    async def shown():
        return (await instances(admin))[instance_id].role == role
    await wait_for(shown, 10, f"{instance_id} shown as {common_pb2.Role.Name(role)}")


async def test_roles_are_in_the_etcd_records_and_list_instances(admin):
    roles = {i: info.role for i, info in (await instances(admin)).items()}
    assert roles == {PREFILL: common_pb2.ROLE_PREFILL, DECODE_1: common_pb2.ROLE_DECODE,
                     DECODE_2: common_pb2.ROLE_DECODE}


async def run_batch(cluster, admin, client, reference, num: int, tag: str) -> None:
    baseline = await free_blocks(admin, {PREFILL, DECODE_1, DECODE_2})
    prompts, max_tokens = mixed_batch(num, tag)
    results = await asyncio.gather(*(complete(client, cluster, p, m) for p, m in zip(prompts, max_tokens)))
    assert [tokens for _, tokens in results] == reference(prompts, max_tokens)
    num_moved = 0
    for request_id, _ in results:  # prefilled on the prefill instance, decoded on a decode instance, one stage
        moves = await committed(admin, request_id)  # none: parked --pd-handoff-hold-s, it finished there first
        assert [(m.src_instance_id, m.trigger, m.num_stages) for m in moves] in ([], [(PREFILL, "pd", 1)]), moves
        assert all(m.dst_instance_id in (DECODE_1, DECODE_2) for m in moves)
        num_moved += len(moves)
    assert num_moved >= 1  # on a loaded 2-core box 16 of 40 (hand-offs ~0.3 s each there: most finish first)
    await wait_blocks_back(admin, baseline)


async def test_pd_batch_of_40_keeps_every_token_and_moves_each_request_once(cluster, admin, client, reference):
    await run_batch(cluster, admin, client, reference, NUM_BATCH, "pd")


async def test_streaming_continues_through_the_handoff_without_gap_or_duplicate(cluster, admin, client, reference,
                                                                                tiny_model_dir):
    prompt, max_tokens = "A streamed request moves from prefill to decode", 48
    stream = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
    token_ids, texts, request_id = [], [], None
    async for chunk in stream:
        request_id = chunk.id
        if chunk.choices:
            token_ids += chunk.choices[0].model_extra.get("token_ids") or []
            texts.append(chunk.choices[0].text)
    assert token_ids == reference([prompt], [max_tokens])[0]
    assert "".join(texts) == Tokenizer.from_dir(tiny_model_dir).decode(token_ids)
    [move] = await committed(admin, request_id)
    assert move.src_instance_id == PREFILL and move.dst_instance_id in (DECODE_1, DECODE_2)


async def test_a_constrained_request_keeps_to_its_grammar_across_the_handoff(cluster, admin, client, reference):
    """The prefill instance samples the first token under the grammar; the decode instance rebuilds its
    state from the tokens so far and goes on: the same tokens as one engine that never handed off."""
    prompt, max_tokens, regex = "A constrained request moves from prefill to decode", 40, "([a-z]+ ){60}"
    completion = await client.completions.create(model=model_name(cluster), prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, extra_body={"return_token_ids": True,
                                                                            "guided_regex": regex})
    (choice,) = completion.choices
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    assert choice.model_extra["token_ids"] == reference([prompt], [max_tokens], grammar)[0]
    assert re.fullmatch(r"([a-z]+ )*[a-z]*", choice.text) and choice.finish_reason == "length"
    [move] = await committed(admin, completion.id)
    assert move.src_instance_id == PREFILL and move.dst_instance_id in (DECODE_1, DECODE_2)


async def test_set_role_under_load_both_then_decode_then_prefill_fails_no_request(cluster, admin, client,
                                                                                  reference):
    await set_role(admin, DECODE_2, common_pb2.ROLE_BOTH)
    prompts, max_tokens = mixed_batch(12, "setrole")
    # long enough to be running through both switches (with m + 60 a full run saw them all finish in 0.3 s,
    # before the first poll found one running)
    max_tokens = [m + 400 for m in max_tokens]
    requests = asyncio.gather(*(complete(client, cluster, p, m) for p, m in zip(prompts, max_tokens)))

    async def running_on_both():
        return (await instances(admin))[DECODE_2].num_running > 0
    await wait_for(running_on_both, 30, f"requests running on {DECODE_2}")
    await set_role(admin, DECODE_2, common_pb2.ROLE_DECODE)
    await asyncio.sleep(1.0)
    await set_role(admin, DECODE_2, common_pb2.ROLE_PREFILL)
    results = await requests
    assert [tokens for _, tokens in results] == reference(prompts, max_tokens)

    async def emptied_of_decodes():  # a prefill instance keeps no decoding request
        info = (await instances(admin))[DECODE_2]
        return info.num_running == 0 and info.num_waiting == 0
    await wait_for(emptied_of_decodes, 30, f"{DECODE_2} empty")


async def test_killing_the_only_decode_instance_mid_run_completes_every_request(cluster, admin, client,
                                                                                reference):
    roles = {i: info.role for i, info in (await instances(admin)).items()}
    assert [i for i, r in roles.items() if r == common_pb2.ROLE_DECODE] == [DECODE_1]
    prompts, max_tokens = mixed_batch(10, "killed")
    # Long enough that several decode at once on the decode instance for a while: shared-memory
    # hand-offs land all ten within a few ms, and 100 more tokens each were done before a poll saw them.
    max_tokens = [m + 400 for m in max_tokens]
    requests = asyncio.gather(*(complete(client, cluster, p, m) for p, m in zip(prompts, max_tokens)))

    async def decoding_on_the_decode_instance():
        return (await instances(admin))[DECODE_1].num_running >= 3
    await wait_for(decoding_on_the_decode_instance, 60, f"requests decoding on {DECODE_1}")
    os.kill(pid_of(cluster, DECODE_1), signal.SIGKILL)
    results = await requests
    assert [tokens for _, tokens in results] == reference(prompts, max_tokens)

    # Healed: once a decode instance serves again, a request decoding on a prefill instance moves to it.
    # long enough to outlast the role change and the manager's next tick (400 tokens once finished first)
    prompt, max_tokens = "A request that waits for a decode instance", 1000
    request = asyncio.ensure_future(complete(client, cluster, prompt, max_tokens))

    async def owner():
        reply = await admin.ListRequests(manager_pb2.AdminListRequestsRequest(), timeout=5)
        return next((r.instance_id for r in reply.requests if r.num_output_tokens >= 8), None)
    source = await wait_for(owner, 30, "the request decoding on a prefill instance")
    other = ({PREFILL, DECODE_2} - {source}).pop()
    await set_role(admin, other, common_pb2.ROLE_DECODE)
    request_id, tokens = await request
    assert tokens == reference([prompt], [max_tokens])[0]
    moves = await committed(admin, request_id)
    assert [(m.src_instance_id, m.dst_instance_id, m.trigger) for m in moves][-1:] == [(source, other, "pd")]
