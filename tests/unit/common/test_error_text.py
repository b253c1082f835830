"""An exception without a message still says what it was (a TimeoutError from asyncio.wait_for)."""

import pytest

from services.common.error_text import error_text, typed_error_text

pytestmark = pytest.mark.timeout(10)


def test_an_exception_without_a_message_is_named_by_its_type():
    assert error_text(TimeoutError()) == "TimeoutError"
    assert typed_error_text(TimeoutError()) == "TimeoutError"


def test_an_exception_with_a_message_says_it():
    assert error_text(ConnectionError("refused")) == "refused"
    assert typed_error_text(ConnectionError("refused")) == "ConnectionError: refused"
