"""A real FrontendServer on a loopback port, in front of scripted instances (no cluster).

`scripted_frontend(answers)` serves the frontend's whole HTTP app (admission, parsing,
streaming, metrics) while `ScriptedInstances` plays the instances; it yields the base URL
and cleans up on exit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

from services.frontend.dispatch import Dispatcher
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from services.frontend.tool_calls import ToolCallFormat
from tests.loopback_http import served_on_loopback
from tests.unit.frontend.factories import FakeMembership, ScriptedInstances, entry


class ThreadNotingTokenizer:
    """Letters a..t; notes whether any encode ran on the event loop's thread."""

    def __init__(self) -> None:
        self.encoded_on_loop = False

    def encode(self, text, add_special_tokens=True):
        self.encoded_on_loop |= threading.current_thread() is threading.main_thread()
        return [ord(c) - ord("a") for c in text]

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t) for t in token_ids)

    def token_bytes(self, token_id):
        return self.decode([token_id]).encode()


@contextlib.asynccontextmanager
async def scripted_frontend(answers: dict | None = None, *, tokenizer: Any = None, max_model_len: int = 1000,
                            metrics: FrontendMetrics | None = None, is_serving: bool = True,
                            tool_call_format: ToolCallFormat | None = None, instances: ScriptedInstances | None = None,
                            **server_options: Any) -> AsyncIterator[str]:
    """The frontend's base URL ("http://127.0.0.1:PORT"); instance "a" (serving unless `is_serving` is
    False) answers from `answers` (ScriptedInstances' script), or as `instances` do. `server_options` override
    FrontendServer's test defaults."""
    model = ServedModel("m", max_model_len=max_model_len, vocab_size=32, tokenizer=tokenizer or ThreadNotingTokenizer(),
                        tool_call_format=tool_call_format)
    dispatcher = Dispatcher(None, FakeMembership(entry("a", is_serving)), cooldown_s=5)
    runner = RequestRunner(dispatcher, instances or ScriptedInstances(answers or {}), max_resumes=3)
    options = {"api_keys": (), "max_inflight": 8, "max_body_bytes": 1 << 20, **server_options}
    server = FrontendServer(model, runner, dispatcher, metrics or FrontendMetrics(), **options)
    async with served_on_loopback(server.app()) as base_url:
        yield base_url
