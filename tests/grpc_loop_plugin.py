"""pytest plugin: a grpc.aio channel or server must not outlive the event loop it was made on, open.

pytest-asyncio gives each test a loop of its own. A channel (or server) left open when its test's loop closes
still gets completions from gRPC's one poller, which hands them to the loop the call was made on; once a later
test runs, that raises "Exception in callback PollerCompletionQueue._handle_events: Event loop is closed" (seen
once in a loaded run, from a harness that never closed its ManagerClient). So every channel and server made
in this process is remembered (weakly), and after each test's teardown one still open on a closed loop fails
that test's teardown, naming the test that made it and where.
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass

import pytest
from grpc.aio import _channel, _server


@dataclass(frozen=True)
class _Made:
    ref: weakref.ReferenceType
    test: str
    where: str  # the innermost frames of tests/ and services/ that made it

    def is_left_open(self) -> bool:
        made = self.ref()
        if made is None or not made._loop.is_closed():
            return False
        return not made._channel.closed() if isinstance(made, _channel.Channel) else made._server.is_running()


_made: list[_Made] = []
_current_test = ["(collection)"]


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "/site-packages/" not in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                       for f in reversed(frames[-4:]))


def _remembering(cls: type) -> None:
    original = cls.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        _made.append(_Made(weakref.ref(self), _current_test[0], _where()))
    cls.__init__ = init


_remembering(_channel.Channel)
_remembering(_server.Server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    _current_test[0] = item.nodeid
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    outcome = yield
    left_open = [made for made in _made if made.is_left_open()]
    _made[:] = [made for made in _made if made.ref() is not None and made not in left_open]
    if left_open and outcome.exception is None:
        outcome.force_exception(AssertionError("grpc.aio objects left open on a closed event loop (close them on "
                                               "the loop that made them): " + "; ".join(
                                                   f"{type(made.ref()).__name__} made in {made.test} at {made.where}"
                                                   for made in left_open)))
