"""Stream resume and abort through real sockets: the frontend's HTTP server and gRPC clients
in this process, talking to scripted InstanceService servers on free 127.0.0.1 ports.

A scripted instance produces token i of a request as `(sum(prompt) + i) % 97 + 3`, so a
request resumed elsewhere continues exactly where it stopped (as greedy decoding would),
and it can be told to fail after some tokens the way a dying instance does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import grpc
import pytest
from structlog.testing import capture_logs

from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc, manager_pb2, manager_pb2_grpc
from services.common.grpc_server import start_grpc_server
from services.common.prefix_hash import MAX_PREFIX_CHUNKS, prefix_chunk_keys
from services.frontend.dispatch import Dispatcher, InstanceEntry
from services.frontend.generation import InstanceId
from services.frontend.instance_client import InstanceClients
from services.frontend.manager_client import ManagerClient, StaticLeader
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from tests.integration.eventually import eventually
from tests.loopback_http import served_on_loopback
from tests.unit.frontend.factories import FakeMembership

pytestmark = pytest.mark.timeout(60)

MODEL = "scripted"


def expected_token(prompt: list[int], index: int) -> int:
    return (sum(prompt) + index) % 97 + 3


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 + 3 for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def encode_chat(self, messages, add_generation_prompt=True, continue_final_message=False, **variables):
        return self.encode("".join(f"{m['role']}:{m['content']}\n" for m in messages))


class ScriptedInstance(instance_pb2_grpc.InstanceServiceServicer):
    def __init__(self, fail_after: int | None = None, delay_s: float = 0.0, first_start: int | None = None) -> None:
        self.fail_after = fail_after  # tokens streamed before the stream breaks with UNAVAILABLE
        self.delay_s = delay_s
        # Said first in a chunk with no token, as an instance does whose prefill takes more than a step.
        self.first_start = first_start
        self.requests: list[instance_pb2.GenerateRequest] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()

    async def Generate(self, request, context):
        self.requests.append(request)
        prompt, start = list(request.prompt_token_ids), len(request.resume_token_ids)
        assert list(request.resume_token_ids) == [expected_token(prompt, i) for i in range(start)]
        self.running.add(request.request_id)
        try:
            if self.first_start is not None:
                yield instance_pb2.GenerateChunk(request_id=request.request_id, token_index=start,
                                                 first_start=self.first_start)
            for index in range(start, request.sampling.max_tokens):
                if self.fail_after is not None and index - start >= self.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "instance is going away")
                await asyncio.sleep(self.delay_s)
                token = expected_token(prompt, index)
                last = index == request.sampling.max_tokens - 1
                yield instance_pb2.GenerateChunk(
                    request_id=request.request_id, token_index=index, token_ids=[token],
                    text=CharTokenizer().decode([token]), num_prompt_tokens=len(prompt) if index == start else 0,
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED)
        finally:
            self.running.discard(request.request_id)

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return instance_pb2.AbortResponse(was_running=True)


class ScriptedManager(manager_pb2_grpc.ManagerServiceServicer):
    def __init__(self, pick: int, delay_s: float = 0.0) -> None:
        self.pick = pick  # index of the instance it answers with
        self.delay_s = delay_s
        self.entries: list[InstanceEntry] = []
        self.requests: list[manager_pb2.DispatchRequest] = []

    async def Dispatch(self, request, context):
        self.requests.append(request)
        await asyncio.sleep(self.delay_s)
        entry = self.entries[self.pick]
        return manager_pb2.DispatchResponse(instance_id=entry.instance_id, address=entry.address, policy="scripted")


@pytest.fixture
async def cluster():
    """Start scripted instances, then a frontend over them; yields (base_url, instances, metrics)."""
    servers = []

    async def start(*instances: ScriptedInstance, max_resumes: int = 3, manager: ScriptedManager | None = None,
                    generate_timeout_s: float = 30, manager_timeout_s: float = 5.0):
        entries = []
        for i, servicer in enumerate(instances):
            server = await start_grpc_server(
                "127.0.0.1", 0, [(instance_pb2_grpc.add_InstanceServiceServicer_to_server, servicer)],
                ["ferry.v1.InstanceService"])
            servers.append(server)
            servicer.instance_id, servicer.address = f"i{i}", server.address
            entries.append(InstanceEntry(InstanceId(f"i{i}"), server.address, True))
        metrics = FrontendMetrics()
        manager_client = None
        if manager is not None:
            manager.entries = entries
            server = await start_grpc_server(
                "127.0.0.1", 0, [(manager_pb2_grpc.add_ManagerServiceServicer_to_server, manager)],
                ["ferry.v1.ManagerService"])
            servers.append(server)
            manager_client = ManagerClient(StaticLeader(server.address), timeout_s=manager_timeout_s)
            frontends.push_async_callback(manager_client.close)  # on this test's loop, as the frontend's app does
        dispatcher = Dispatcher(manager_client, FakeMembership(*entries), cooldown_s=5.0,
                                on_fallback=metrics.dispatch_fallbacks.inc)
        clients = InstanceClients(generate_timeout_s=generate_timeout_s, abort_timeout_s=2)
        runner = RequestRunner(dispatcher, clients, max_resumes=max_resumes, on_resume=metrics.resumes.inc,
                               on_handoff=metrics.handoffs.inc)
        model = ServedModel(MODEL, max_model_len=512, vocab_size=128, tokenizer=CharTokenizer())
        app = FrontendServer(model, runner, dispatcher, metrics, api_keys=(), max_inflight=8,
                             max_body_bytes=1 << 20).app()
        frontends.push_async_callback(clients.close)
        return await frontends.enter_async_context(served_on_loopback(app)), metrics

    async with contextlib.AsyncExitStack() as frontends:
        yield start
    for server in servers:
        await server.stop(0)


PROMPT = "abc"
PROMPT_IDS = CharTokenizer().encode(PROMPT)


async def post(base_url, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base_url}/v1/completions", json=body) as response:
            return response.status, await response.read()


def sse_events(raw: bytes) -> list[bytes]:
    """The data of each server-sent event of a stream's body, `[DONE]` included."""
    return [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]


async def stream_chunks(base_url, body) -> list[dict]:
    """A streamed request's chunks, once it answered 200 and ended with [DONE]."""
    status, raw = await post(base_url, body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_a_broken_stream_resumes_on_another_instance_without_gaps(cluster):
    dying, healthy = ScriptedInstance(fail_after=4), ScriptedInstance()
    base_url, metrics = await cluster(dying, healthy)
    chunks = await stream_chunks(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "stream": True,
                                            "return_token_ids": True})
    token_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert token_ids == [expected_token(PROMPT_IDS, i) for i in range(10)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(dying.requests) == 1 and len(healthy.requests) == 1
    assert len(healthy.requests[0].resume_token_ids) == 4
    resumed = healthy.requests[0]  # with the text the client has of those tokens, so none is lost or repeated
    assert resumed.HasField("resume_text") and resumed.resume_text == "".join(c["choices"][0]["text"] for c in chunks[:4])
    assert not dying.requests[0].HasField("resume_text")
    assert healthy.requests[0].request_id == dying.requests[0].request_id == chunks[0]["id"]
    await eventually(lambda: dying.aborted == [chunks[0]["id"]], what="the broken one told to free its blocks")
    assert metrics.resumes._value.get() == 1


async def test_an_instance_lost_during_the_prefill_resumes_the_prompt_from_where_it_started(cluster):
    """The dying instance said first_start in a chunk with no token (its prefill took more than a step), then
    broke before its first token: the resume sends that first_start back (the prompt is cut there again, so
    its bits stay those of a run that never failed). Chunks with no token reach the client as nothing."""
    dying, healthy = ScriptedInstance(fail_after=0, first_start=48), ScriptedInstance(first_start=0)
    base_url, metrics = await cluster(dying, healthy)
    chunks = await stream_chunks(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True,
                                            "return_token_ids": True})
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[expected_token(PROMPT_IDS, i)] for i in range(6)]
    (lost,), (resumed,) = dying.requests, healthy.requests
    assert not lost.HasField("resume_first_start") and not resumed.resume_token_ids
    assert resumed.HasField("resume_first_start") and resumed.resume_first_start == 48
    assert metrics.resumes._value.get() == 1


async def test_a_stream_longer_than_the_generate_timeout_is_fine_while_its_chunks_keep_coming(cluster):
    """--generate-timeout-s bounds the wait for the next chunk, not the stream: 2 s of steady
    chunks under a 1.5 s timeout is no failure; an instance silent for longer is one. (With a 0.5 s
    timeout, at load 14 the healthy instance's chunks, served by this test's own loop, came later than
    that too: 3 resumes.)"""
    steady, silent, healthy = ScriptedInstance(delay_s=0.05), ScriptedInstance(delay_s=0.05), ScriptedInstance()
    base_url, metrics = await cluster(steady, generate_timeout_s=1.5)
    status, raw = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "stream": True})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and metrics.resumes._value.get() == 0
    silent.delay_s = 3.0  # its first chunk comes after the timeout
    base_url, metrics = await cluster(silent, healthy, generate_timeout_s=1.5)
    status, raw = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True})
    assert status == 200 and metrics.resumes._value.get() == 1 and len(healthy.requests) == 1


async def test_resumes_are_bounded_then_an_error_event(cluster):
    instances = [ScriptedInstance(fail_after=1) for _ in range(3)]
    base_url, _ = await cluster(*instances, max_resumes=2)
    status, raw = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "stream": True})
    assert status == 200
    events = sse_events(raw)
    error = json.loads(events[-2])["error"]
    assert "after 2 resumes" in error["message"] and error["type"] == "server_error"
    assert events[-1] == b"[DONE]"


async def test_failure_before_the_first_token_gets_its_own_status(cluster):
    base_url, _ = await cluster(ScriptedInstance(fail_after=0), max_resumes=0)
    status, raw = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True})
    assert status == 503
    assert "instance is going away" in json.loads(raw)["error"]["message"]


async def test_non_streaming_request_resumes_too(cluster):
    base_url, _ = await cluster(ScriptedInstance(fail_after=2), ScriptedInstance())
    status, raw = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "return_token_ids": True})
    assert status == 200
    body = json.loads(raw)
    assert body["choices"][0]["token_ids"] == [expected_token(PROMPT_IDS, i) for i in range(6)]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


async def test_a_client_that_goes_away_cancels_and_aborts(cluster):
    slow = ScriptedInstance(delay_s=0.05)
    base_url, metrics = await cluster(slow)
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{base_url}/v1/completions",
                                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True})
        await response.content.readline()
        request_id = slow.requests[0].request_id
        assert slow.running == {request_id}
        response.close()
    for _ in range(100):
        if not slow.running and slow.aborted:
            break
        await asyncio.sleep(0.05)
    assert slow.running == set() and slow.aborted == [request_id]
    assert metrics.requests.labels("/v1/completions", "499")._value.get() == 1  # counted, as the client's leaving


async def test_non_streaming_client_that_goes_away_aborts_too(cluster):
    slow = ScriptedInstance(delay_s=0.05)
    base_url, _ = await cluster(slow)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                                   "max_tokens": 400},
                               timeout=aiohttp.ClientTimeout(total=0.5))
    for _ in range(100):
        if not slow.running and slow.aborted:
            break
        await asyncio.sleep(0.05)
    assert slow.running == set() and len(slow.aborted) == 1


def fallbacks(metrics) -> float:
    return metrics.dispatch_fallbacks._value.get()


async def test_the_managers_choice_is_used(cluster):
    first, second = ScriptedInstance(), ScriptedInstance()
    manager = ScriptedManager(pick=1)
    base_url, metrics = await cluster(first, second, manager=manager)
    status, _ = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "priority": 2})
    assert status == 200
    assert not first.requests and len(second.requests) == 1 and fallbacks(metrics) == 0
    (request,) = manager.requests
    assert request.request_id == second.requests[0].request_id
    assert (request.num_prompt_tokens, request.max_tokens, request.priority) == (3, 3, 2)
    assert second.requests[0].priority == 2


async def test_dispatch_sends_the_prompts_chunk_keys_also_on_a_resume(cluster):
    dying, healthy = ScriptedInstance(fail_after=2), ScriptedInstance()
    manager = ScriptedManager(pick=0)  # after i0 fails it is excluded: the frontend places the resume itself
    base_url, _ = await cluster(dying, healthy, manager=manager)
    prompt = "the same long system prompt, then a question"  # 44 tokens: 2 full chunks
    status, _ = await post(base_url, {"model": MODEL, "prompt": prompt, "max_tokens": 6})
    assert status == 200 and len(healthy.requests) == 1
    keys = prefix_chunk_keys(CharTokenizer().encode(prompt), MAX_PREFIX_CHUNKS)
    assert len(keys) == 2
    first, resumed = manager.requests
    assert list(first.prefix_chunk_keys) == list(resumed.prefix_chunk_keys) == keys  # the prompt only
    assert list(resumed.exclude_instance_ids) == ["i0"]


async def test_a_slow_manager_is_passed_over_and_counted(cluster):
    only = ScriptedInstance()
    base_url, metrics = await cluster(only, manager=ScriptedManager(pick=0, delay_s=1.0), manager_timeout_s=0.2)
    started = asyncio.get_running_loop().time()
    status, _ = await post(base_url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    assert status == 200 and len(only.requests) == 1
    assert fallbacks(metrics) == 1
    assert asyncio.get_running_loop().time() - started < 1.0  # the 200 ms deadline, not the manager's 1 s


async def test_a_bug_after_the_200_ends_the_stream_with_an_error_event(cluster, monkeypatch):
    # Before, only FerryError and a reset connection were caught there: the client read two events and
    # then waited on an open stream for ever (found by review).
    from services.frontend import openai_response
    original, calls = openai_response.ResponseFormatter.chunk, []

    def chunk(self, delta):
        calls.append(delta)
        if len(calls) == 3:
            raise KeyError("a formatting bug")
        return original(self, delta)

    monkeypatch.setattr(openai_response.ResponseFormatter, "chunk", chunk)
    base_url, _ = await cluster(ScriptedInstance())
    async with aiohttp.ClientSession() as session, session.post(
            f"{base_url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                                               "stream": True}) as response:
        async with asyncio.timeout(5):
            raw = await response.read()
    assert response.status == 200
    assert b'"type": "server_error"' in raw.replace(b'"type":"server_error"', b'"type": "server_error"')
    assert raw.rstrip().endswith(b"data: [DONE]")


async def test_an_abort_the_instance_did_not_answer_is_sent_again():
    # A request handed to an instance whose Attach then failed, with its Abort refused too, decoded there
    # for no client until the instance's watchdog dropped it 30 s later (found by a fault run).
    from services.common.etcd_launcher import free_port
    from services.frontend.generation import Target
    port = free_port()
    clients = InstanceClients(generate_timeout_s=5, abort_timeout_s=2)
    instance = ScriptedInstance()
    abort = clients.abort_soon(Target(InstanceId("a"), f"127.0.0.1:{port}"), "r-1")
    await asyncio.sleep(0.1)  # the first try is refused: nothing listens yet
    server = await start_grpc_server("127.0.0.1", port, [(instance_pb2_grpc.add_InstanceServiceServicer_to_server,
                                                          instance)], ["ferry.v1.InstanceService"])
    try:
        await asyncio.wait_for(abort, 5)
        assert instance.aborted == ["r-1"]
    finally:
        await clients.close()
        await server.stop(0)


async def test_an_abort_of_a_dead_instance_warns_once_when_its_tries_are_spent():
    # After a resume off a dead instance the frontend still tries its Abort 3 times (it may be alive behind a
    # partition): one warning when they are spent, the tries before it at info.
    from services.common.etcd_launcher import free_port
    from services.frontend.generation import Target
    clients = InstanceClients(generate_timeout_s=5, abort_timeout_s=0.5)
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(clients.abort_soon(Target(InstanceId("a"), f"127.0.0.1:{free_port()}"), "r-1"), 5)
    finally:
        await clients.close()
    tries = [(e["event"], e["log_level"], e["num_tries"]) for e in logs if e["event"].startswith("abort_")]
    assert tries == [("abort_retrying", "info", 1), ("abort_retrying", "info", 2), ("abort_failed", "warning", 3)]


async def test_an_abort_that_ran_past_its_deadline_is_sent_again():
    # An instance whose event loop is blocked past the Abort's deadline never ran the handler: the request
    # would decode there for no client until its watchdog. Before, only UNAVAILABLE was tried again.
    class SlowOnce(ScriptedInstance):
        async def Abort(self, request, context):
            if not self.aborted:
                self.aborted.append("(blocked)")
                await asyncio.sleep(1.0)  # past the 0.3 s deadline
            return await super().Abort(request, context)

    from services.frontend.generation import Target
    clients = InstanceClients(generate_timeout_s=5, abort_timeout_s=0.3)
    instance = SlowOnce()
    server = await start_grpc_server("127.0.0.1", 0, [(instance_pb2_grpc.add_InstanceServiceServicer_to_server,
                                                       instance)], ["ferry.v1.InstanceService"])
    try:
        await asyncio.wait_for(clients.abort_soon(Target(InstanceId("a"), server.address), "r-1"), 5)
        assert instance.aborted == ["(blocked)", "r-1"]
    finally:
        await clients.close()
        await server.stop(0)


async def test_closing_the_clients_ends_every_abort_and_leaves_no_channel():
    # close() waited one Abort timeout while an abort could still be between its tries, which then
    # dialled into the closed pool (found by review).
    from services.common.etcd_launcher import free_port
    from services.frontend.generation import Target
    clients = InstanceClients(generate_timeout_s=5, abort_timeout_s=0.3)
    abort = clients.abort_soon(Target(InstanceId("a"), f"127.0.0.1:{free_port()}"), "r-1")  # nothing listens
    await asyncio.sleep(0.05)
    await clients.close()
    assert abort.done() and clients._pool.addresses == []


async def test_the_managers_no_instance_answer_is_told_apart_from_no_answer():
    from services.common.errors import Unavailable
    from services.common.etcd_launcher import free_port
    from services.frontend.generation import Declined
    from tests.unit.frontend.factories import make_spec

    class NoInstance(manager_pb2_grpc.ManagerServiceServicer):
        async def Dispatch(self, request, context):
            raise Unavailable("no serving instance besides those excluded")

    server = await start_grpc_server("127.0.0.1", 0, [(manager_pb2_grpc.add_ManagerServiceServicer_to_server,
                                                       NoInstance())], ["ferry.v1.ManagerService"])
    answering = ManagerClient(StaticLeader(server.address), timeout_s=1.0)
    silent = ManagerClient(StaticLeader(f"127.0.0.1:{free_port()}"), timeout_s=0.3)  # nothing listens
    try:
        assert isinstance(await answering.dispatch(make_spec(), [InstanceId("a")]), Declined)
        assert await silent.dispatch(make_spec(), [InstanceId("a")]) is None
    finally:
        await answering.close()
        await silent.close()
        await server.stop(0)
