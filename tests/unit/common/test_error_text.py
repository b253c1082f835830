"""An exception without a message still says what it was (a TimeoutError from asyncio.wait_for)."""

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from services.common.error_text import error_text, typed_error_text

pytestmark = pytest.mark.timeout(10)


def test_an_exception_without_a_message_is_named_by_its_type():
    assert error_text(TimeoutError()) == "TimeoutError"
    assert typed_error_text(TimeoutError()) == "TimeoutError"


def test_an_exception_with_a_message_says_it():
    assert error_text(ConnectionError("refused")) == "refused"
    assert typed_error_text(ConnectionError("refused")) == "ConnectionError: refused"


def test_a_grpc_error_is_its_code_and_details_on_one_line():
    """Before, an AioRpcError (one of ETCD_ERRORS) read as its multi-line `<AioRpcError of RPC that terminated
    with: ...debug_error_string = ...>`."""
    error = AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(), details="failed to connect",
                        debug_error_string="UNKNOWN:Error received from peer")
    assert error_text(error) == "UNAVAILABLE: failed to connect"
    assert typed_error_text(error) == "AioRpcError: UNAVAILABLE: failed to connect"
    assert error_text(AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, Metadata(), Metadata())) == "DEADLINE_EXCEEDED"
