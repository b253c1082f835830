"""Configuration of one frontend process (`python -m services.frontend`)."""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.config import check_non_negative, check_positive, knob, parse_config
from services.common.etcd_client import EtcdKnobs, EtcdStartupKnobs
from services.common.etcd_endpoints import check_address_flag, check_host_flags
from services.common.ids import check_id_flag
from services.common.logging import LogKnobs
from services.common.tls import PeerKnobs
from services.frontend.sampling_defaults import override_values
from services.frontend.tool_calls import ToolCallParserSetting

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class FrontendConfig(EtcdKnobs, EtcdStartupKnobs, PeerKnobs, LogKnobs):
    """The OpenAI-compatible HTTP API of a ferry cluster (completions, chat, streaming)."""

    model: pathlib.Path = knob(pathlib.Path("models/smollm2-135m-instruct"), "model folder (config.json, tokenizer.json, tokenizer_config.json) the cluster serves")
    served_model_name: str = knob("", "model name clients put in `model` (default: the model folder's name)")
    frontend_id: str = knob("", "id of this frontend in etcd (default: <host>-<port>)")
    host: str = knob("0.0.0.0", "address to bind the HTTP server to")
    port: int = knob(8000, "HTTP port")
    etcd_endpoints: list[str] = knob([], "etcd endpoints host:port (comma-separated); empty = only --manager-address")
    cluster: str = knob("ferry", "cluster name: etcd keys live under /ferry/<cluster>/")
    manager_address: str = knob("", "leader manager host:port (default: read /ferry/<cluster>/manager/leader from etcd)")
    api_key: list[str] = knob([], "accepted API keys (repeat the flag or separate with commas); empty = no auth")
    allowed_origins: list[str] = knob([], "origins whose browser pages may call the API (CORS; repeat the flag or "
                                          "separate with commas), e.g. https://chat.example.com, or * for any; "
                                          "empty = no CORS headers, so browsers refuse cross-origin calls")
    max_body_bytes: int = knob(MIB, "largest request body in bytes; larger ones get 413")
    max_inflight: int = knob(256, "most requests in flight (each choice of an n > 1 request counts, and each "
                                   "/tokenize or /detokenize call, and each body being read, so bodies in memory "
                                   "stay within this x --max-body-bytes); more get 429")
    keepalive_timeout_s: float = knob(75.0, "seconds an HTTP connection may sit without a complete request (idle "
                                            "keep-alive, or headers arriving too slowly) before it is closed")
    body_timeout_s: float = knob(30.0, "seconds a request body may take to arrive; slower ones get 408")
    send_timeout_s: float = knob(30.0, "seconds a client may take in none of its answer (a stream or a JSON body) "
                                       "while the frontend waits to write more; one that stops reading is "
                                       "disconnected, freeing its --max-inflight slots and its answer's memory (one "
                                       "that reads, however slowly, is not)")
    tool_call_parser: ToolCallParserSetting = knob(
        ToolCallParserSetting.AUTO, "how tool calls are read from chat answers when a request sends tools (with "
        "tool_choice auto): hermes (<tool_call>{json}</tool_call>: Qwen2.5/3, Hermes, SmolLM3), llama3_json "
        "(Llama 3.1+: the answer is {\"name\", \"parameters\"} JSON), mistral ([TOOL_CALLS] then a JSON list of "
        "calls, or name[ARGS]{...} calls where the chat template shows [ARGS]), auto (the format the chat template "
        "shows, if any) or none (tools only with tool_choice none)")
    generation_config: str = knob(
        "auto", "where requests' default temperature, top_p, top_k, min_p, repetition_penalty and chat max_tokens "
        "(max_new_tokens) come from, as in vLLM: auto (the --model folder's generation_config.json, if any), vllm "
        "(none: OpenAI's defaults) or a folder holding a generation_config.json; a value a request sends wins")
    override_generation_config: str = knob(
        "", "JSON object of those fields (generation_config.json's names) setting or replacing the generation "
        "config's, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 512}' (in the --config YAML file a mapping "
        "too); null removes one; empty (the default): no overrides")
    reject_unknown_fields: bool = knob(
        False, "answer a request with a top-level field the frontend does not know (a misspelt max_token, another "
        "server's option) with a 400 \"Unrecognized request argument supplied\", as OpenAI does; off (the default, "
        "as vLLM): such a field is ignored, named in the answer's x-ferry-ignored-fields header and logged "
        "(unknown_request_fields) once per field name")
    max_model_len: int = knob(0, "longest prompt + output in tokens (0 = the longest the model serves: max_position_embeddings from config.json, or less for longrope RoPE)")
    dispatch_timeout_s: float = knob(0.2, "deadline of ManagerService/Dispatch; past it the frontend picks an instance itself")
    generate_timeout_s: float = knob(600.0, "longest wait for the next chunk of an instance's token stream "
                                            "(the first one included: a queued request waits too); past it the "
                                            "instance is taken as failed and the request resumes elsewhere. The "
                                            "stream as a whole has no deadline")
    abort_timeout_s: float = knob(2.0, "deadline of InstanceService/Abort sent when a client goes away")
    max_resumes: int = knob(3, "how often a request is re-dispatched after its instance failed mid-stream (only "
                               "an instance that took the request and failed counts; see --resume-wait-s)")
    resume_wait_s: float = knob(30.0, "longest wait of a resume for a serving instance when none serves (a lone "
                                      "instance frozen or restarting: its lease lapsed); it resumes as soon as one "
                                      "registers, and the wait spends no resume. The default covers an instance "
                                      "lease TTL (5 s) plus a launcher's or systemd's restart under load (a tiny "
                                      "model's took 17 s at load average 20); 0: fail at once")
    max_handoffs: int = knob(16, "most live-migration hand-offs one request follows in a row with no "
                                    "new token between them; past it the request is resumed elsewhere (any number "
                                    "of hand-offs with progress between them is followed)")
    failed_instance_cooldown_s: float = knob(5.0, "seconds the local fallback skips an instance whose stream just failed")
    shutdown_grace_s: float = knob(5.0, "seconds running requests get to finish on SIGTERM; those still running then end with an SSE error event (streams) or a 503")

    def __post_init__(self) -> None:
        check_id_flag("--frontend-id", self.frontend_id)
        self.check_etcd_flags(self.cluster, self.etcd_endpoints)
        check_host_flags(self, ("host",))
        self.tls.check()
        self.etcd_access.check()
        check_positive(self, ("max_body_bytes", "max_inflight", "dispatch_timeout_s", "generate_timeout_s",
                              "abort_timeout_s", "keepalive_timeout_s", "body_timeout_s", "send_timeout_s"))
        check_non_negative(self, ("failed_instance_cooldown_s", "shutdown_grace_s", "resume_wait_s"))
        if self.max_resumes < 0:
            raise ValueError(f"--max-resumes must be >= 0, got {self.max_resumes}")
        if self.max_handoffs < 1:
            raise ValueError(f"--max-handoffs must be >= 1 (0 would resume every migrated request by recompute), "
                             f"got {self.max_handoffs}")
        if self.max_model_len < 0:
            raise ValueError(f"--max-model-len must be >= 0 (0 = from config.json), got {self.max_model_len}")
        override_values(self.override_generation_config)  # a ValueError naming the flag
        check_address_flag("--manager-address", [self.manager_address] if self.manager_address else [])
        if not self.etcd_endpoints and not self.manager_address:
            raise ValueError("set --etcd-endpoints (membership and leader) or --manager-address (or both)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name


def load_config(argv: Sequence[str] | None = None, prog: str | None = None) -> FrontendConfig:
    """Parse the frontend's flags; list flags may be repeated (`--api-key a --api-key b`). `prog` names
    the command in a usage error (the launcher's, where it checks the flags it passes on)."""
    return parse_config(FrontendConfig, "frontend", _join_repeated_list_flags(argv), prog=prog)


def _join_repeated_list_flags(argv: Sequence[str] | None) -> list[str] | None:
    """`--api-key a --api-key b` → `--api-key a,b` (the common parser keeps only the last)."""
    if argv is None:
        import sys
        argv = sys.argv[1:]
    hints = typing.get_type_hints(FrontendConfig)
    list_flags = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(FrontendConfig)
                  if typing.get_origin(hints[f.name]) is list}
    out: list[str] = []
    joined: dict[str, int] = {}  # flag -> index of its value in `out`
    args = list(argv)
    i = 0
    while i < len(args):
        flag, has_eq, value = args[i].partition("=")
        if flag in list_flags and (has_eq or i + 1 < len(args)):
            if not has_eq:
                i += 1
                value = args[i]
            if flag in joined:
                out[joined[flag]] += "," + value
            else:
                out.extend([flag, value])
                joined[flag] = len(out) - 1
        else:
            out.append(args[i])
        i += 1
    return out
