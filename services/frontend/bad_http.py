"""HTTP that aiohttp's parser refuses (a bad request line, method or header, a header line over 8190 bytes,
over 128 headers, a bad chunk size, TLS sent to this port). aiohttp answers it itself, before any route or
middleware, with the status it chose and `Connection: close`; FrontendRunner's connections
(JsonErrorRequestHandler) write that answer as an OpenAI error body instead of aiohttp's plain text, so a
client's JSON error handling holds for it too. aiohttp's ERROR with a traceback for each becomes one
`bad_http_request` info line per kind per 10 s (BadHttpLog): the client's fault, at its will.

The hook is aiohttp's `RequestHandler.handle_error` (web_protocol.py), the one place that builds those
answers (and the 500/504 of an error no middleware caught); aiohttp is pinned (pyproject.toml), and
tests/unit/frontend/test_bad_http.py checks the answers on raw sockets.

A parse error in a body whose headers were already handed to a handler (a bad chunk size in a later
packet) is the one case aiohttp gets wrong: its C parser drops that body without ending it, so the
handler waited --body-timeout-s for the rest and answered 408. The handler's body now fails at once
with the parser's reason, the handler answers it as a 400 (server.py), and the connection closes.

Each of these answers carries an x-request-id made for it (request_ids.py) and is counted through the
app's ON_OWN_ANSWER (ferry_frontend_requests_total, endpoint `unparsable`: http_errors.py).

Pipelining: the parser returns the requests it parsed from a read only if the whole read parses, so a
good request followed by garbage in the same read (one TCP packet) was lost: the garbage's 400 was the
only answer. A request's headers end only at a blank line, so data_received hands the parser each read
in pieces that end there (`_header_ends`): a request whose headers are complete is queued before the
parser meets what follows; it is answered, then the 400, and the connection closes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from http import HTTPStatus

import structlog
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo
from aiohttp.web_request import BaseRequest

from services.common.log_sampling import LogSampler
from services.frontend.error_bodies import error_body
from services.frontend.request_ids import HEADER as REQUEST_ID_HEADER
from services.frontend.request_ids import answer_request_id

log = structlog.get_logger(__name__)

DECODED_CODINGS = ("gzip", "deflate")  # request body codings aiohttp decodes without an optional module
UNSUPPORTED_CODING = "unsupported_content_encoding"  # the error code of a body in any other coding
MAX_MESSAGE_CHARS = 300  # of the parser's message in the body (it quotes the client's bytes, up to ~100)
_HEADERS_END = re.compile(rb"\n\r?\n")  # a blank line (the parser takes a bare LF as a line's end too)
_MODULE_MISSING = re.compile(r"content-encoding: .*\((\w+)\)\. Please install")  # br, zstd: aiohttp's advice

AnswerHook = Callable[[int], None]
ON_OWN_ANSWER = web.AppKey("on_own_answer", AnswerHook)  # told the status of each answer aiohttp makes itself


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's per-connection handler, with its own error answers written as OpenAI error bodies."""

    on_answer: AnswerHook | None = None  # the app's ON_OWN_ANSWER, if it has one

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp's logs the error (BadHttpLog samples it) and raises ConnectionError where a response has begun
        super().handle_error(request, status, exc, message)
        code = None
        if isinstance(exc, ContentEncodingError) and message and (missing := _MODULE_MISSING.search(message)):
            message, code = unsupported_coding(missing[1]), UNSUPPORTED_CODING  # not "Please install `Brotli`"
        response = web.json_response(bad_http_body(status, message, code), status=status,
                                     headers={REQUEST_ID_HEADER: answer_request_id(request)})
        response.force_close()  # as aiohttp's: the connection's framing can no longer be trusted
        if self.on_answer is not None:
            self.on_answer(status)
        return response

    def data_received(self, data: bytes) -> None:
        for piece in _header_ends(data):
            num_messages = len(self._messages)
            super().data_received(piece)
            if len(self._messages) > num_messages and isinstance(refused := self._messages[-1][0], _ErrInfo):
                self._fail_cut_bodies(refused)
                return  # the parser is broken for good: the rest is not read

    def _fail_cut_bodies(self, refused: _ErrInfo) -> None:
        """The parser refused what came after headers it had handed on: fail the bodies it left unended
        (the running handler's, or a queued request's) with its reason instead of answering the refusal
        as a request of its own, and close the connection after their answers."""
        queued = [payload for _, payload in list(self._messages)[:-1]]
        running = [self._current_request.content] if self._current_request is not None else []
        cut = [body for body in running + queued if body is not EMPTY_PAYLOAD and not body.is_eof()]
        if not cut:
            return  # a request of its own: handle_error answers it
        self._messages.pop()
        for body in cut:
            _fail(body, refused.exc)
        self.close()


def _header_ends(data: bytes) -> Iterator[bytes]:
    """`data` cut after each blank line (as separate reads would deliver it): where a request's headers
    can end. One piece for a read with none (a body's next bytes, say)."""
    if b"\n" not in data:  # a compact JSON body's bytes: memchr's pace, not the regex's (30x slower)
        yield data
        return
    start = 0
    for end in _HEADERS_END.finditer(data):
        yield data[start:end.end()]
        start = end.end()
    if start < len(data) or not data:
        yield data[start:]


def _fail(body: StreamReader, cause: BaseException) -> None:
    error = RequestPayloadError(f"the request body's framing is broken: {cause}")
    error.__cause__ = cause  # the parser's message, for the 400 (server.py's _unreadable_body)
    body.set_exception(error)
    body.feed_eof()  # ended: aiohttp does not linger on it after the answer, meet the error and log it as unhandled


def bad_http_body(status: int, message: str | None, code: str | None = None) -> dict:
    """The OpenAI error body of an answer aiohttp makes itself: a parser's refusal (4xx, its message
    on one line) or an error no middleware caught (5xx, no details: the log has them)."""
    phrase = HTTPStatus(status).phrase
    code = code or phrase.lower().replace(" ", "_").replace("-", "_")
    if status >= 500:
        return error_body(f"{phrase}; the server logged it", type_="server_error", code=code)
    return error_body(f"the HTTP request could not be parsed: {one_line(message or phrase)}", code=code)


def unsupported_coding(coding: str) -> str:
    """The 400's message for a request body in a Content-Encoding this server does not decode."""
    return (f"the request body's Content-Encoding {coding!r} is not one this server decodes; send it "
            f"uncompressed, or compressed with {' or '.join(DECODED_CODINGS)}")


def one_line(message: str) -> str:
    """aiohttp's parser message ("Invalid header token:\\n\\n  b'Bad Header: y'\\n       ^") without its
    newlines and the caret line that points into the quoted bytes."""
    parts = [line.strip() for line in message.splitlines()]
    text = " ".join(part for part in parts if part and part != "^")
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


class _JsonErrorServer(web.Server):
    def __init__(self, *args, on_answer: AnswerHook | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._on_answer = on_answer

    def __call__(self) -> RequestHandler:
        handler = JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.on_answer = self._on_answer
        return handler


class FrontendRunner(web.AppRunner):
    """web.AppRunner whose connections answer in JSON what aiohttp answers itself (JsonErrorRequestHandler)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # starts and freezes the app, as AppRunner does
        return _JsonErrorServer(server.request_handler, request_factory=server.request_factory,
                                handler_cancellation=server.handler_cancellation,
                                on_answer=self.app.get(ON_OWN_ANSWER), **server._kwargs)


class BadHttpLog(logging.Filter):
    """Drops aiohttp.server's records about a client's malformed HTTP (an HttpProcessingError with
    a 4xx code: aiohttp answered it) and logs `bad_http_request` instead, sampled per kind."""

    def __init__(self) -> None:
        super().__init__()
        self._sampler = LogSampler()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.WARNING or not isinstance(exc, HttpProcessingError) or not 400 <= exc.code < 500:
            return True  # (aiohttp logs a first request's bad method, say TLS sent to this port, at debug)
        if (suppressed := self._sampler.admit(type(exc).__name__)) is not None:
            log.info("bad_http_request", error=type(exc).__name__, status=exc.code, message=exc.message[:200],
                     remote=record.args[0] if isinstance(record.args, tuple) and record.args else None,
                     suppressed=suppressed)
        return False


def quiet_bad_http_log() -> None:
    """Install BadHttpLog on aiohttp.server's logger (once per process)."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, BadHttpLog) for f in server_log.filters):
        server_log.addFilter(BadHttpLog())
