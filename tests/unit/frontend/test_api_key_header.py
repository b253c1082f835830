"""An Authorization header that is not UTF-8 is a wrong key (401), not a crash: the key's text
held surrogates that `.encode()` refused, so any client without a key could get a 500 and a
traceback in the log per request (found by review)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.unit.frontend.scripted_frontend import scripted_frontend

pytestmark = pytest.mark.timeout(30)


async def status_with_raw_authorization(base_url: str, value: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(base_url.rsplit(":", 1)[1]))
    body = json.dumps({"model": "m", "prompt": "ab", "max_tokens": 1}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                 b"Authorization: " + value + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    reply = await reader.read()
    writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"Bearer right-key\xff", b"\xffBearer right-key"])
async def test_a_key_that_is_not_utf8_is_a_401(value):
    async with scripted_frontend(max_model_len=100, api_keys=("right-key",)) as base_url:
        status, body = await status_with_raw_authorization(base_url, value)
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
