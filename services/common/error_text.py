"""An exception as one line of a log field or an error message. Many carry no message (a TimeoutError
from `asyncio.wait_for`), and `str()` of those is empty: "etcd did not store the mark (); retry"."""

from __future__ import annotations


def error_text(exc: BaseException) -> str:
    """The exception's message, or its type's name where it has none."""
    return str(exc) or type(exc).__name__


def typed_error_text(exc: BaseException) -> str:
    """`Type: message`, or the type's name alone where it has no message."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
