"""The frontend's OpenAPI 3.0 description, served at GET /openapi.json.

Hand-written to match `openai_protocol` (the validation) and `openai_response` (the
bodies): each request field with its type and range, each status the server can answer.
tests/integration/test_frontend_fuzz.py fuzzes the running server against it
(schemathesis), so a field added to the protocol without a line here shows up there.
"""

from __future__ import annotations

from typing import Any

from services.common.prefix_hash import MAX_CACHE_SALT_CHARS
from services.frontend.openai_protocol import MAX_BATCH_CHOICES, MAX_CHOICES, MAX_PROMPTS
from services.frontend.sampling_fields import (MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                              MAX_TOP_LOGPROBS)
from services.frontend.structured_output import MAX_CHOICE_CHARS, MAX_GUIDED_CHOICES
from services.frontend.tool_protocol import MAX_TOOLS

_INT32_MAX = (1 << 31) - 1
_JSON = "application/json"


def openapi_schema(model_name: str, max_model_len: int, max_body_bytes: int, has_api_keys: bool) -> dict[str, Any]:
    generation_errors = _errors(400, 401, 404, 413, 408, 429, 503) if has_api_keys else _errors(400, 404, 413, 408,
                                                                                                  429, 503)
    schema: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "ferry OpenAI-compatible API", "version": "1",
                 "description": f"Serves {model_name!r}: at most {max_model_len} tokens of prompt and output "
                                f"together; request bodies of at most {max_body_bytes} bytes."},
        "paths": {
            "/v1/completions": {"post": _generation("createCompletion", "CompletionRequest", "Completion",
                                                    generation_errors)},
            "/v1/chat/completions": {"post": _generation("createChatCompletion", "ChatCompletionRequest",
                                                         "ChatCompletion", generation_errors)},
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": _json_response("the served model", {"$ref": "#/components/schemas/ModelList"}),
                **(_errors(401) if has_api_keys else {})}}},
            "/v1/models/{model}": {"get": {
                "operationId": "retrieveModel",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json_response("the served model", {"$ref": "#/components/schemas/Model"}),
                              **(_errors(401, 404) if has_api_keys else _errors(404))}}},
            "/tokenize": {"post": _json_call("tokenize", "TokenizeRequest", "Tokenized", has_api_keys)},
            "/detokenize": {"post": _json_call("detokenize", "DetokenizeRequest", "Detokenized", has_api_keys)},
            "/health": {"get": {"operationId": "health", "security": [], "responses": {
                "200": _json_response("serving", {"$ref": "#/components/schemas/Health"}),
                "503": _json_response("no instance serves, or shutting down", {"$ref": "#/components/schemas/Health"})}}},
            "/metrics": {"get": {"operationId": "metrics", "security": [], "responses": {
                "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"operationId": "openapi", "security": [], "responses": {
                "200": _json_response("this document", {"type": "object"})}}},
        },
        "components": {"schemas": _schemas(model_name, max_model_len)},
    }
    if has_api_keys:
        schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"apiKey": []}]
    return schema


def _generation(operation_id: str, request: str, response: str, errors: dict) -> dict[str, Any]:
    return {
        "operationId": operation_id,
        "parameters": [{"name": "X-Request-Id", "in": "header", "required": False,
                        "description": "the client's name for the request: ferry's id becomes "
                                       "<prefix>-<this>-<12 hex> (other than visible ASCII becomes _, "
                                       "cut to 128 characters)",
                        "schema": {"type": "string"}}],
        "requestBody": {"required": True, "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {
            "200": {"description": "the result (JSON), or with stream=true server-sent events ending in [DONE]",
                    "headers": {"x-request-id": {"schema": {"type": "string"}},
                                "x-ferry-ignored-fields": {
                                    "description": "the request's top-level fields the server does not know and "
                                                   "ignored (comma-separated); absent where it knew them all",
                                    "schema": {"type": "string"}}},
                    "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{response}"}},
                                "text/event-stream": {"schema": _SSE_EVENT}}},
            **errors,
        },
    }


def _json_call(operation_id: str, request: str, response: str, has_api_keys: bool) -> dict[str, Any]:
    """A plain JSON POST (no stream, no generation): 200, or 400/404/408/413 (and 401 with keys)."""
    errors = _errors(400, 401, 404, 408, 413) if has_api_keys else _errors(400, 404, 408, 413)
    return {"operationId": operation_id,
            "requestBody": {"required": True, "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
            "responses": {"200": _json_response("the result", {"$ref": f"#/components/schemas/{response}"}), **errors}}


_SSE_EVENT = {"type": "object", "description": "one server-sent event: `data:` is a JSON chunk, the last is [DONE]",
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_ERROR_DESCRIPTIONS = {400: "invalid request (the message names the field)", 401: "missing or wrong API key",
                       404: "no such route, or no such model", 405: "method not allowed", 408: "the body arrived too slowly",
                       413: "body larger than --max-body-bytes", 429: "too many requests in flight",
                       503: "no instance can serve, or shutting down"}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): _json_response(_ERROR_DESCRIPTIONS[s], {"$ref": "#/components/schemas/Error"}) for s in statuses}


def _json_response(description: str, schema: dict) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": schema}}}


def _structured_output_fields() -> dict[str, Any]:
    """response_format and vLLM's guided fields: at most one per request (structured_output.py)."""
    schema = {"type": "object", "description": "a JSON schema"}
    lark = {"type": "string", "minLength": 1, "description": "a Lark grammar (llguidance's dialect)"}
    regex = {"type": "string", "minLength": 1}
    choice = {"type": "array", "minItems": 1, "maxItems": MAX_GUIDED_CHOICES,
              "items": {"type": "string", "minLength": 1, "maxLength": MAX_CHOICE_CHARS}}
    json_schema = {"type": "object", "required": ["name", "schema"], "properties": {
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}, "schema": schema,
        "strict": {"type": "boolean", "nullable": True}, "description": {"type": "string", "nullable": True}}}
    return {
        "response_format": {"oneOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["text"]}}},
            {"type": "object", "required": ["type"], "properties": {"type": {"type": "string",
                                                                            "enum": ["json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"type": "string", "enum": ["json_schema"]}, "json_schema": json_schema}}],
            "nullable": True, "description": "the answer is JSON (json_object), JSON satisfying a schema "
                                             "(json_schema), or free text; constrained decoding"},
        "guided_json": {"oneOf": [schema, {"type": "string"}], "nullable": True,
                        "description": "vLLM: JSON satisfying this schema (or its JSON text)"},
        "guided_regex": {**regex, "nullable": True, "description": "vLLM: text matching this regex"},
        "guided_choice": {**choice, "nullable": True, "description": "vLLM: exactly one of these strings"},
        "guided_grammar": {**lark, "nullable": True, "description": "vLLM: text of this Lark grammar"},
        "structured_outputs": {"type": "object", "nullable": True,
                               "description": "vLLM: exactly one of json, regex, choice, grammar, json_object",
                               "properties": {"json": {"oneOf": [schema, {"type": "string"}]}, "regex": regex,
                                              "choice": choice, "grammar": lark, "json_object": {"type": "boolean"}}},
    }


def _schemas(model_name: str, max_model_len: int) -> dict[str, Any]:
    integer = {"type": "integer"}
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    stop = {"oneOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS}],
            "nullable": True}
    common = {
        "model": {"type": "string", "enum": [model_name, None], "nullable": True, "description": "the served model (default: it)"},
        "max_tokens": {**integer, "minimum": 1, "maximum": max_model_len, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
        "top_k": {**integer, "minimum": -1, "maximum": _INT32_MAX, "nullable": True,
                  "description": "-1 or 0: off"},
        "seed": {**integer, "minimum": -(1 << 63), "maximum": (1 << 64) - 1, "nullable": True},
        "stop": stop,
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
                           "maxItems": MAX_STOP_TOKEN_IDS, "nullable": True,
                           "description": "vLLM: token ids that end the output (kept in token_ids, not the text)"},
        "min_tokens": {**integer, "minimum": 0, "maximum": max_model_len, "nullable": True,
                       "description": "vLLM: no eos, stop token id or stop string ends the output before this many "
                                      "tokens (at most max_tokens)"},
        "add_special_tokens": {"type": "boolean", "nullable": True,
                               "description": "vLLM, completions: the tokenizer's special tokens around a text prompt "
                                              "(default true); chat: only false"},
        "truncate_prompt_tokens": {**integer, "minimum": -1, "maximum": 2**31 - 1, "not": {"enum": [0]},
                                   "nullable": True,
                                   "description": "vLLM: keep only the prompt's last k tokens (-1: the context)"},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True, "description": "only with stream=true",
                           "properties": {"include_usage": {"type": "boolean", "nullable": True}}},
        "n": {**integer, "minimum": 1, "maximum": MAX_CHOICES, "nullable": True,
              "description": "choices, each a request of its own (seed, seed + 1, ... when seeded)"},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
        "logit_bias": {"type": "object", "nullable": True, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                       "description": f"token id (a decimal string) -> bias added to its logit; at most "
                                      f"{MAX_LOGIT_BIAS_ENTRIES} tokens",
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 2,
                               "nullable": True, "description": "vLLM: > 1 discourages prompt and output tokens"},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True,
                  "description": "vLLM: drop tokens below min_p x the most likely one's probability"},
        "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS, "nullable": True,
                       "description": "vLLM: share cached prompt prefixes only with requests of the same salt "
                                      "(one per tenant)"},
        "prompt_logprobs": {**integer, "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True,
                            "description": "vLLM: each prompt token's logprob and rank plus the top k at its position "
                                           "(completions: per choice; chat: at the top); not with stream"},
        "ignore_eos": {"type": "boolean", "nullable": True, "description": "ferry: keep going past end-of-sequence"},
        "return_token_ids": {"type": "boolean", "nullable": True, "description": "ferry: choices carry token_ids"},
        "return_tokens_as_token_ids": {"type": "boolean", "nullable": True,
                                       "description": "vLLM: logprobs name each token \"token_id:N\""},
        "priority": {**integer, "minimum": -_INT32_MAX, "maximum": _INT32_MAX, "nullable": True,
                     "description": "ferry: higher runs first when the KV cache is short"},
        "request_id": {"type": "string", "nullable": True,
                       "description": "vLLM: the client's name for the request, as the X-Request-Id header "
                                      "(which wins)"},
        **_structured_output_fields(),
    }
    tool_call = {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string", "minLength": 1},
            "arguments": {"type": "string", "description": "a JSON object's text"}}}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}],
            "nullable": True, "description": "required except for assistant messages"},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": tool_call, "description": "assistant: calls it made"},
        "tool_call_id": {"type": "string", "description": "tool: the call this is the result of"}}}
    usage = {"type": "object", "properties": {name: integer for name in
                                              ("prompt_tokens", "completion_tokens", "total_tokens")}}
    return {
        "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
            **common,
            "prompt": {"oneOf": [{"type": "string", "minLength": 1}, token_ids,
                                 {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                  "items": {"oneOf": [{"type": "string", "minLength": 1}, token_ids]}}],
                       "description": "text, token ids, or a batch of those: prompt i's n choices are "
                                      f"choices i*n .. i*n+n-1 (at most {MAX_BATCH_CHOICES} choices in all)"},
            "logprobs": {**integer, "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True},
            "max_tokens": {**integer, "minimum": 0, "maximum": max_model_len, "nullable": True,
                           "description": "0 only with echo: the prompt alone (to score it with logprobs)"},
            "echo": {"type": "boolean", "nullable": True,
                     "description": "each choice's text starts with its prompt; with logprobs, the prompt's logprobs "
                                    "come first (its first token's is null)"},
            "best_of": {**integer, "enum": [1], "nullable": True},
        }},
        "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
            **common,
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_completion_tokens": {**integer, "minimum": 1, "maximum": max_model_len, "nullable": True},
            "logprobs": {"type": "boolean", "nullable": True},
            "top_logprobs": {**integer, "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True,
                             "description": "needs logprobs=true"},
            "tools": {"type": "array", "maxItems": MAX_TOOLS, "nullable": True, "items": {
                "type": "object", "required": ["function"], "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {"type": "object", "required": ["name"], "properties": {
                        "name": {"type": "string"}, "description": {"type": "string"},
                        "parameters": {"type": "object"}}}}}},
            "tool_choice": {"oneOf": [
                {"type": "string", "enum": ["auto", "none", "required"]},
                {"type": "object", "required": ["function"], "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}],
                "nullable": True,
                "description": "auto (default with tools): calls are parsed from the answer (--tool-call-parser); "
                               "none: the tools are shown, nothing is parsed; required: one or more calls, forced "
                               "by a grammar; {\"type\": \"function\", \"function\": {\"name\": ...}}: one "
                               "call of that tool. Forced calls end with finish_reason tool_calls"},
            "parallel_tool_calls": {"type": "boolean", "nullable": True,
                                    "description": "false: one call at most"},
        }},
        "Completion": {"type": "object", "required": ["id", "object", "choices"], "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
            "created": integer, "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": integer, "text": {"type": "string"}, "finish_reason": {"type": "string", "nullable": True},
                "logprobs": {"type": "object", "nullable": True,
                             "description": "with echo, the prompt's tokens first (the first one's logprob is null)",
                             "properties": {
                    "tokens": {"type": "array", "items": {"type": "string"}},
                    "token_logprobs": {"type": "array", "items": {"type": "number", "nullable": True}},
                    "top_logprobs": {"type": "array", "items": {"type": "object", "nullable": True,
                                                                 "additionalProperties": {"type": "number"}}},
                    "text_offset": {"type": "array", "items": integer}}},
                "token_ids": {"type": "array", "items": integer},
                "prompt_token_ids": {"type": "array", "items": integer}}}}}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "choices"], "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
            "created": integer, "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": integer, "finish_reason": {"type": "string", "nullable": True},
                "message": {"type": "object", "properties": {"role": {"type": "string"},
                                                             "content": {"type": "string", "nullable": True},
                                                             "tool_calls": {"type": "array", "items": tool_call}}},
                "token_ids": {"type": "array", "items": integer}}}}}},
        "TokenizeRequest": {"type": "object", "description": "vLLM's /tokenize: exactly one of prompt and messages",
                            "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
                            "properties": {
            "model": {"type": "string", "enum": [model_name, None], "nullable": True},
            "prompt": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": message},
            "add_special_tokens": {"type": "boolean", "nullable": True,
                                   "description": "prompt only (default true); a chat template writes its own"}}},
        "Tokenized": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": integer, "max_model_len": integer, "tokens": {"type": "array", "items": integer}}},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "model": {"type": "string", "enum": [model_name, None], "nullable": True},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
        "Detokenized": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        "Model": {"type": "object", "required": ["id"], "properties": {
            "id": {"type": "string"}, "object": {"type": "string"}, "created": integer,
            "owned_by": {"type": "string"}, "max_model_len": integer}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}},
        "Health": {"type": "object", "required": ["status"], "properties": {
            "status": {"type": "string", "enum": ["ok", "no_instances", "stopping"]}, "num_instances": integer,
            "num_registered": integer}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"], "properties": {
                "message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"oneOf": [{"type": "string"}, {"type": "integer"}], "nullable": True}}}}},
    }
