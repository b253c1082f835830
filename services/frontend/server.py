"""The HTTP server: the routes and thin aiohttp handlers (body → openai_protocol →
RequestRunner → openai_response → body), admission (--max-inflight) and request bodies
(--max-body-bytes, --body-timeout-s). The middlewares live with their nouns: errors as HTTP
answers (http_errors.py), CORS (cors.py), API keys (api_keys.py).

A generation request: parse and validate, admit (bounded in-flight), tokenize, start one
runner task per choice (`n` per prompt, and a completions batch may hold several prompts;
each choice feeds its own `ReqState`), then answer from the states' deltas (answer.py: one
JSON body, or an SSE stream merged by choice index). A client that goes away cancels the
handler (handler_cancellation), which cancels the runner, which aborts the request on
its instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import structlog
from aiohttp import hdrs, web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from services.common.errors import ResourceExhausted, Unavailable
from services.common.prefix_hash import MAX_PREFIX_CHUNKS, prefix_chunk_keys
from services.frontend.answer import AnswerWriter, Choice, cancel_task
from services.frontend.api_keys import ApiKeyPolicy
from services.frontend.cors import CorsPolicy
from services.frontend.dispatch import Dispatcher
from services.frontend.generation import GenerateSpec, RequestId
from services.frontend.bad_http import (DECODED_CODINGS, ON_OWN_ANSWER, UNSUPPORTED_CODING, one_line, quiet_bad_http_log,
                                        unsupported_coding)
from services.frontend.http_errors import RETRY_AFTER_S, BodyTimeout, ErrorAnswers, too_large
from services.frontend.in_flight import InFlight
from services.frontend.metrics import FrontendMetrics
from services.frontend.off_loop import in_thread
from services.frontend.json_body import parse_json_body
from services.frontend.openai_protocol import (Endpoint, ModelNotFound, ParsedRequest, parse_chat_request,
                                               parse_completion_request)
from services.frontend.openapi import openapi_schema
from services.frontend.prompt_checks import prompt_errors_in_client_terms, resolve_max_tokens
from services.frontend.openai_response import ResponseFormatter
from services.frontend.req_state import Delta, ReqState
from services.frontend.request_error import RequestError
from services.frontend.request_ids import REQUEST_ID_KEY, client_request_id, new_request_id, stamp_request_id
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import PreparedPrompt, ServedModel
from services.frontend.shown_markers import MarkerPlacer
from services.frontend.tokenize_protocol import parse_detokenize_request, parse_tokenize_request
from services.frontend.unknown_fields import IGNORED_FIELDS_KEY, UnknownFieldPolicy, stamp_ignored_fields

log = structlog.get_logger(__name__)


class FrontendServer:
    def __init__(self, model: ServedModel, runner: RequestRunner, dispatcher: Dispatcher, metrics: FrontendMetrics,
                 *, api_keys: Sequence[str], max_inflight: int, max_body_bytes: int,
                 body_timeout_s: float = 30.0, send_timeout_s: float = 30.0,
                 allowed_origins: Sequence[str] = (), reject_unknown_fields: bool = False) -> None:
        self._model = model
        self._runner = runner
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._max_inflight = max_inflight
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._cors = CorsPolicy(allowed_origins)
        self._api_keys = ApiKeyPolicy(api_keys)
        self._unknown_fields = UnknownFieldPolicy(reject_unknown_fields)
        self._errors = ErrorAnswers(metrics)
        self._answers = AnswerWriter(metrics, send_timeout_s)
        self._openapi_args = (model.name, max_body_bytes, bool(api_keys))
        self._num_inflight = 0
        self.in_flight = InFlight()  # what a SIGTERM lets finish, then cuts (in_flight.py)
        self._started_at = int(time.time())
        self.is_accepting = True  # False while shutting down: /health and new requests answer 503

    def app(self) -> web.Application:
        quiet_bad_http_log()
        app = web.Application(client_max_size=self._max_body_bytes,
                              middlewares=[self._errors.middleware, self._cors.middleware,
                                           self._api_keys.middleware])
        app.on_response_prepare.append(self._cors.on_prepare)
        app.on_response_prepare.append(stamp_request_id)  # every answer carries an x-request-id
        app.on_response_prepare.append(stamp_ignored_fields)  # ... and one that ignored fields names them
        app[ON_OWN_ANSWER] = self._errors.count_own_answer  # ... those aiohttp makes itself are counted too
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    # ---- handlers ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve-model: the served model's card, 404 model_not_found for any other name."""
        name = request.match_info["model"]
        if name != self._model.name:
            raise ModelNotFound(f"model {name!r} does not exist; this server serves {self._model.name!r}")
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self._model.name, "object": "model", "created": self._started_at, "owned_by": "ferry",
                "max_model_len": self._max_model_len()}

    def _max_model_len(self) -> int:
        """The model's context (config.json, --max-model-len), or less where the instances' KV caches hold less."""
        return self._dispatcher.max_model_len(self._model.max_model_len)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt's or a chat's token ids, without generating (one --max-inflight slot)."""
        parsed = parse_tokenize_request(await self._read_json(request), self._model.name)
        with self._admitted(1):
            token_ids = await in_thread(self._model.tokenize, parsed)
        return web.json_response({"count": len(token_ids), "max_model_len": self._max_model_len(),
                                  "tokens": token_ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of token ids (one --max-inflight slot)."""
        token_ids = parse_detokenize_request(await self._read_json(request), self._model.name)
        with self._admitted(1):
            text = await in_thread(self._model.detokenize, token_ids)
        return web.json_response({"prompt": text})

    async def health(self, request: web.Request) -> web.Response:
        num_instances = self._dispatcher.num_serving()
        # without etcd (only --manager-address) this frontend has no instance list: the manager places
        is_healthy = self.is_accepting and (num_instances > 0 or not self._dispatcher.lists_instances)
        status = "ok" if is_healthy else ("no_instances" if self.is_accepting else "stopping")
        body = {"status": status, "num_instances": num_instances,  # serving; registered counts drained ones too
                "num_registered": self._dispatcher.num_registered()}
        return web.json_response(body,
                                 status=200 if is_healthy else 503,
                                 headers=None if is_healthy else {"Retry-After": str(RETRY_AFTER_S)})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": self._metrics.content_type})

    async def openapi(self, request: web.Request) -> web.Response:
        """Built per request: the context limit is the least any serving instance takes, which changes."""
        name, max_body_bytes, has_api_keys = self._openapi_args
        return web.json_response(openapi_schema(name, self._max_model_len(), max_body_bytes, has_api_keys=has_api_keys))

    # ---- one generation ----------------------------------------------------------------

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        arrived_at = time.monotonic()
        parsed, client_id = await self._parse(request, endpoint)
        with self._admitted(parsed.num_choices), self.in_flight.starting():
            max_model_len = self._max_model_len()
            if parsed.truncate_prompt_tokens == -1:  # as many as the served context holds (the KV caches' too)
                parsed = replace(parsed, truncate_prompt_tokens=max_model_len)
            if parsed.needs_grammar:  # llguidance checks it: up to a few hundred ms
                parsed = await in_thread(self._model.constrained, parsed)
                self._metrics.constrained.labels(parsed.constraint_field).inc()
            prepared = await in_thread(self._model.prepared_prompts, parsed)
            prompts = [p.token_ids for p in prepared]
            resolved = [resolve_max_tokens(parsed, len(ids), max_model_len, index)
                        for index, ids in enumerate(prompts)]  # a 400 for any prompt refuses them all
            request_id = new_request_id("chatcmpl" if endpoint is Endpoint.CHAT else "cmpl", client_id)
            request[REQUEST_ID_KEY] = request_id
            created = int(time.time())  # one for every choice and chunk of the response
            choices = [choice for index, (each, prompt) in enumerate(zip(resolved, prepared))
                       for choice in self._prompt_choices(each, request_id, prompt, index, created)]
            log.info("request_received", request_id=request_id, client_request_id=client_id,
                     endpoint=endpoint.value, stream=parsed.stream,
                     num_prompt_tokens=sum(map(len, prompts)), num_prompts=len(prompts),
                     max_tokens=resolved[0].sampling.max_tokens, n=parsed.n)
            self._metrics.prompt_tokens.inc(sum(map(len, prompts)))
            tasks = [asyncio.create_task(self._runner.run(c.state, c.spec), name=f"request:{c.state.request_id}")
                     for c in choices]
            try:
                streams = [self._timed(prompt_errors_in_client_terms(c.state.deltas(), parsed, index // parsed.n),
                                       arrived_at) for index, c in enumerate(choices)]
                with self.in_flight.serving([c.state for c in choices], tasks):
                    if parsed.stream:
                        return await self._answers.stream(request, parsed, request_id, choices, streams)
                    return await self._answers.complete(request, request_id, choices, streams)
            except asyncio.CancelledError:  # the client went away (handler_cancellation)
                log.info("client_disconnected", request_id=request_id,
                         num_output_tokens=sum(c.state.num_output_tokens for c in choices))
                raise
            finally:
                for task in tasks:
                    await cancel_task(task)
                for choice in choices:
                    _log_finished(choice.state)

    def _prompt_choices(self, parsed: ParsedRequest, request_id: RequestId, prompt: PreparedPrompt,
                        prompt_index: int, created: int) -> list[Choice]:
        """Prompt `prompt_index`'s `n` choices, indexes prompt_index * n + j (j = 0 .. n-1)."""
        prefix_keys = tuple(prefix_chunk_keys(prompt.token_ids, MAX_PREFIX_CHUNKS, parsed.sampling.cache_salt))
        return [self._choice(parsed, request_id, prompt.token_ids, prefix_keys, prompt_index * parsed.n + j, j,
                             prompt.echo_text, created)
                for j in range(parsed.n)]

    def _choice(self, parsed: ParsedRequest, request_id: RequestId, prompt_ids: Sequence[int],
                prefix_keys: tuple[int, ...], index: int, seed_offset: int, echo_text: str, created: int) -> Choice:
        """Choice `index`: a request of its own (id `<id>-<index>` when there are several), seeded
        seed + `seed_offset` (its place among its prompt's n), so a batch answers as its prompts
        would one by one."""
        sampling = parsed.sampling
        if seed_offset and sampling.seed is not None:
            sampling = replace(sampling, seed=(sampling.seed + seed_offset) % 2**64)
        sub_id = request_id if parsed.num_choices == 1 else RequestId(f"{request_id}-{index}")
        state = self._req_state(parsed, sub_id, prompt_ids)
        formatter = ResponseFormatter(parsed, request_id, created, self._model, index, echo_text,
                                      self._model.tool_call_format,
                                      tuple(tag for _, tag in self._model.shown_marker_ids))
        spec = GenerateSpec(sub_id, tuple(prompt_ids), sampling, parsed.priority, prefix_chunk_keys=prefix_keys)
        return Choice(state, spec, formatter)

    def _req_state(self, parsed: ParsedRequest, request_id: RequestId, prompt_ids: Sequence[int]) -> ReqState:
        """A choice's state; where its answer's tool calls are read, with the markers the parser needs in its text."""
        reads_calls = parsed.endpoint is Endpoint.CHAT and parsed.tool_use.parses_calls
        markers = MarkerPlacer(dict(self._model.shown_marker_ids), self._model.tokenizer, prompt_ids) \
            if reads_calls and self._model.shown_marker_ids else None
        return ReqState(request_id, prompt_ids, self._model.decode, markers)

    async def _parse(self, request: web.Request, endpoint: Endpoint) -> tuple[ParsedRequest, str | None]:
        """The request, and the id its client named it with (request_ids.py), if any."""
        body = await self._read_json(request)
        if ignored := self._unknown_fields.check(body, endpoint):
            request[IGNORED_FIELDS_KEY] = ignored
        client_id = client_request_id(request.headers, body)
        if endpoint is Endpoint.CHAT:
            return parse_chat_request(body, self._model.name, self._model.sampling_defaults), client_id
        return parse_completion_request(body, self._model.name, self._model.sampling_defaults), client_id

    async def _read_json(self, request: web.Request) -> dict:
        """The body as a JSON object, within --max-body-bytes and --body-timeout-s. Read and parsed in a
        --max-inflight slot of its own (the caller then admits the request as what it asks for, with no await
        between), so the bodies in memory stay within --max-inflight x --max-body-bytes."""
        if request.content_length is not None and request.content_length > self._max_body_bytes:
            raise too_large(self._max_body_bytes)
        with self._admitted(1):
            return parse_json_body(await self._read_body(request))

    async def _read_body(self, request: web.Request) -> bytes:
        coding = request.headers.get(hdrs.CONTENT_ENCODING, "")
        if coding.strip().lower() not in ("", "identity", *DECODED_CODINGS):  # aiohttp passes others on undecoded
            raise RequestError(unsupported_coding(coding), code=UNSUPPORTED_CODING)
        try:
            async with asyncio.timeout(self._body_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(self._max_body_bytes) from None
        except TimeoutError:
            raise BodyTimeout(f"the request body did not arrive within {self._body_timeout_s:g} s "
                              "(--body-timeout-s)") from None
        except RequestPayloadError as exc:  # not what its Content-Encoding says, or broken framing (bad_http.py)
            raise _unreadable_body(request, exc) from None

    async def _timed(self, deltas: AsyncIterator[Delta], arrived_at: float) -> AsyncIterator[Delta]:
        last_token_at: float | None = None
        async for delta in deltas:
            now = time.monotonic()
            self._metrics.observe_tokens(arrived_at, last_token_at, now, len(delta.token_ids))
            if delta.token_ids:
                last_token_at = now
            yield delta

    @contextlib.contextmanager
    def _admitted(self, num_choices: int):
        """Count the request's slots in flight (one per choice of a generation, one for a /tokenize or
        /detokenize call, one for a body being read); over --max-inflight it is a 429 (an idle frontend
        admits any one request, however many choices it asks for)."""
        if not self.is_accepting:
            raise Unavailable("this frontend is shutting down; retry on another one")
        if self._num_inflight and self._num_inflight + num_choices > self._max_inflight:
            raise ResourceExhausted(f"{self._num_inflight} slots are in flight (one per generation choice, "
                                    f"tokenize call or body being read) and this request adds {num_choices}, "
                                    f"over the limit of {self._max_inflight} (--max-inflight); retry later")
        self._num_inflight += num_choices
        self._metrics.in_flight.inc(num_choices)
        try:
            yield
        finally:
            self._num_inflight -= num_choices
            self._metrics.in_flight.dec(num_choices)


def _unreadable_body(request: web.Request, exc: RequestPayloadError) -> RequestError:
    """A 400 for a body aiohttp could not decode. The body is marked as read: aiohttp would otherwise
    read it again after the answer, meet the same error and log it as an unhandled exception."""
    request.content.feed_eof()
    cause = exc.__cause__
    reason = one_line(getattr(cause, "message", None) or str(exc))
    if isinstance(cause, HttpProcessingError) and not isinstance(cause, ContentEncodingError):
        return RequestError(f"the request body could not be read: {reason}; send it framed as its Content-Length "
                            "or Transfer-Encoding: chunked header says")
    return RequestError(f"the request body could not be read: {reason}; send it uncompressed, or compressed "
                        "as its Content-Encoding header says (gzip, deflate)")


def _log_finished(state: ReqState) -> None:
    log.info("request_finished", request_id=state.request_id, num_output_tokens=state.num_output_tokens,
             finish_reason=state.finish_reason and state.finish_reason.value,
             error=state.error and state.error.message, num_resumes=state.num_resumes,
             num_handoffs=state.num_handoffs)
