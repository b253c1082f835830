"""Fixtures shared by every test layer: tiny random-weight models built on the fly; the reaper plugin."""

from __future__ import annotations

import gc
import os
import pathlib

import pytest
import structlog

from services.common.etcd_launcher import PORT_RANGE_ENV, port_range
from services.instance.models.tiny import build_tiny_model
from tests.torch_threads import one_torch_thread  # noqa: F401 (autouse: every test module)

# Every process a test starts ends with this pytest, even a SIGKILLed one (tests/reaper.py).
pytest_plugins = ["tests.reaper_plugin", "tests.grpc_loop_plugin"]


def pytest_configure() -> None:
    plain_tracebacks()
    split_ports()


def pytest_collection_finish() -> None:
    """Every module is imported now (torch, the models, grpc): a full garbage collection no longer walks their
    objects (400 000), which took 2 s a collection at load 15, every thread of the process paused (an event loop, an
    engine thread): 10.4 s in 5 collections over test_migration.py and the engine tests, 1.6 s so."""
    gc.freeze()


def plain_tracebacks() -> None:
    """Service code run in-process logs a traceback plain, as the services do (services/common/logging.py).
    structlog's default renders it with rich, every frame's locals included, in the logging call on the event
    loop: 0.4 s a log.exception on a quiet machine, 8 s at load 15, past the bounds of tests that wait for a
    loop that logs one (test_the_watchdog_outlives_a_failed_abort_and_frees_the_rest failed so)."""
    processors = [p for p in structlog.get_config()["processors"] if not isinstance(p, structlog.dev.ConsoleRenderer)]
    structlog.configure(processors=[*processors,
                                    structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)])


def split_ports() -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker and every process it starts
    picks ports from a slice of its own: two workers never race for one not yet bound."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and PORT_RANGE_ENV not in os.environ:
        low, high = port_range()
        width = (high - low + 1) // int(count)
        first = low + int(worker.removeprefix("gw")) * width
        os.environ[PORT_RANGE_ENV] = f"{first}-{first + width - 1}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny GQA Llama with tied embeddings and a real byte-level BPE tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gqa-tied", "gqa-tied", seed=0)


@pytest.fixture(scope="session")
def tiny_mha_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny MHA Llama with untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-mha-untied", "mha-untied", seed=0)
