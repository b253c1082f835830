"""Every answer the frontend gives carries an x-request-id: a generation's is its request's id, any other
answer's one made for it (`req-<32 hex>`, or `req-<client id>-<12 hex>` on the client's X-Request-Id, as a
request's would be). Before, an answer refused before a request existed (a 400 bad JSON, 401, 404 model,
404 path, 405, 413, 429, 503 ...) and every non-generation answer (/health, /v1/models) had none, so a
client had nothing to quote to an operator for it (a review)."""

from __future__ import annotations

import asyncio
import re

import pytest
from structlog.testing import capture_logs

from services.frontend.generation import FinishReason
from tests.unit.frontend.factories import chunk
from tests.unit.frontend.scripted_frontend import scripted_frontend
from tests.unit.frontend.test_bad_http import exchange
from tests.unit.frontend.test_body_admission import start_slow_body

pytestmark = pytest.mark.timeout(30)

COMPLETION = b'{"model": "m", "prompt": "ab", "max_tokens": 1}'
FRESH_ID = re.compile(r"req-[0-9a-f]{32}")


def request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{headers}\r\n")
    return head.encode() + body


ANSWERS = {  # what is sent: the status it gets
    "bad JSON": (request("POST", "/v1/completions", b"{nope"), 400),
    "no API key": (request("POST", "/v1/chat/completions", COMPLETION), 401),
    "model not found": (request("GET", "/v1/models/other"), 404),
    "no such path": (request("GET", "/v1/nothing"), 404),
    "wrong method": (request("GET", "/v1/completions"), 405),
    "body too large": (request("POST", "/tokenize", b'{"prompt": "' + b"a" * 300 + b'"}'), 413),
    "health": (request("GET", "/health"), 200),
    "models": (request("GET", "/v1/models"), 200),
    "metrics": (request("GET", "/metrics"), 200),
    "unparsable": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n", 400),
}
OPEN_WITH_A_KEY = ("health", "metrics", "unparsable")  # answered without one: the rest need it to be what they are


def status_and_id(answer: bytes) -> tuple[int, str | None]:
    head = answer.partition(b"\r\n\r\n")[0].decode()
    status_line, *lines = head.split("\r\n")
    ids = [value for name, _, value in (line.partition(": ") for line in lines) if name.lower() == "x-request-id"]
    assert len(ids) <= 1, head
    return int(status_line.split()[1]), ids[0] if ids else None


def key_header(name: str) -> str:
    return "" if name == "no API key" or name in OPEN_WITH_A_KEY else "Authorization: Bearer k\r\n"


async def test_every_answer_carries_a_fresh_request_id_where_no_request_was_created():
    async with scripted_frontend(api_keys=("k",), max_body_bytes=200) as base_url:
        for name, (data, expected_status) in ANSWERS.items():
            data = data.replace(b"Host: x\r\n", b"Host: x\r\n" + key_header(name).encode(), 1)
            status, request_id = status_and_id(await asyncio.to_thread(exchange, base_url, data))
            assert status == expected_status, name
            assert request_id is not None and FRESH_ID.fullmatch(request_id), (name, request_id)


async def test_a_refusal_s_id_is_built_on_the_client_s_and_logged_with_the_refusal():
    async with scripted_frontend(api_keys=("k",)) as base_url:
        with capture_logs() as logs:
            for name in ("bad JSON", "no API key", "model not found", "no such path"):
                data = ANSWERS[name][0].replace(b"Host: x\r\n", b"Host: x\r\nX-Request-Id: trace 9\r\n"
                                                + key_header(name).encode())
                status, request_id = status_and_id(await asyncio.to_thread(exchange, base_url, data))
                assert status == ANSWERS[name][1] and re.fullmatch(r"req-trace_9-[0-9a-f]{12}", request_id), name
                refused = [(e["request_id"], e["client_request_id"]) for e in logs if e["event"] == "request_refused"]
                if name != "no such path":  # the router's 404 is no refusal of a request (not logged)
                    assert refused[-1] == (request_id, "trace_9"), name
        assert len(refused) == 3


async def test_a_429_and_a_503_carry_one_too():
    async with scripted_frontend(max_inflight=1, body_timeout_s=20) as base_url:
        slow = start_slow_body(base_url)  # holds the one slot while its body is read
        try:
            await asyncio.sleep(0.5)
            answer = await asyncio.to_thread(exchange, base_url, request("POST", "/v1/completions", COMPLETION))
        finally:
            slow.close()
        status, request_id = status_and_id(answer)
        assert status == 429 and FRESH_ID.fullmatch(request_id)
    async with scripted_frontend(is_serving=False) as base_url:
        status, request_id = status_and_id(await asyncio.to_thread(exchange, base_url, request("GET", "/health")))
        assert status == 503 and FRESH_ID.fullmatch(request_id)


async def test_a_generation_s_answer_keeps_its_request_s_id():
    answers = {"a": ([chunk(0, 1, finish=FinishReason.LENGTH)], None)}
    async with scripted_frontend(answers) as base_url:
        data = request("POST", "/v1/completions", COMPLETION, "X-Request-Id: trace-1\r\n")
        answer = await asyncio.to_thread(exchange, base_url, data)
    status, request_id = status_and_id(answer)
    assert status == 200 and re.fullmatch(r"cmpl-trace-1-[0-9a-f]{12}", request_id)
    assert f'"id": "{request_id}"'.encode() in answer


