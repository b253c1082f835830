"""The banner `up` prints once every child is healthy: where the API and the admin service are, what the
instances serve (read from etcd), and commands that work as printed."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shlex
import shutil
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from services.common.error_text import typed_error_text
from services.cluster.security import ClusterSecurity
from services.common.errors import FerryError
from services.common.etcd_client import ETCD_ERRORS
from services.common.registry import DRAIN_MARKS, ROLE_MARKS

if TYPE_CHECKING:
    from services.cluster.launcher import LocalCluster

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Serving:
    """What the instances serve, read from etcd once they are up (for the banner)."""

    max_model_len: int  # the longest request every instance takes (its KV cache may hold less than the model)
    drained: tuple[str, ...]  # drain marks in etcd, e.g. kept in --state-dir from an earlier run
    kv_tokens: int = 0  # what the smallest KV cache holds (0: unknown)
    roles_set: tuple[tuple[str, str], ...] = ()  # (instance id, role) set at runtime, kept in etcd

    @property
    def is_kv_bound(self) -> bool:
        """The KV cache, not the model's own context, is what limits a request."""
        return 0 < self.kv_tokens <= self.max_model_len


SHORT_CONTEXT_TOKENS = 1024  # below this the banner says how to get more


async def read_serving(cluster: LocalCluster) -> Serving:
    async with cluster.registry() as registry:
        records, marks = await registry.read("instances"), await registry.read(DRAIN_MARKS)
        role_marks = await registry.read(ROLE_MARKS)
    limits = [r["max_model_len"] for r in records.values() if isinstance(r.get("max_model_len"), int)]
    kv_tokens = [_kv_tokens(r) for r in records.values()]
    roles_set = tuple(sorted((i, str(m.get("role"))) for i, m in role_marks.items()
                             if isinstance(m, dict) and i in records))  # (SetRole needs a running instance)
    return Serving(min(limits, default=0), tuple(sorted(marks)), min(filter(None, kv_tokens), default=0), roles_set)


def _kv_tokens(record: dict) -> int:
    kv = record.get("kv") if isinstance(record.get("kv"), dict) else {}
    num_blocks, block_size = kv.get("num_blocks"), kv.get("block_size")
    return num_blocks * block_size if isinstance(num_blocks, int) and isinstance(block_size, int) else 0


async def print_ready(cluster: LocalCluster) -> None:
    try:
        serving = await read_serving(cluster)
    except (*ETCD_ERRORS, FerryError, ValueError) as exc:  # the banner goes out anyway, without those lines
        log.warning("serving_summary_unavailable", error=typed_error_text(exc))
        serving = None
    print(ready_banner(cluster, serving), flush=True)


def _serving_lines(cluster: LocalCluster, serving: Serving | None) -> str:
    if serving is None:
        return ""
    lines = f"  context    : {serving.max_model_len} tokens per request (prompt + output)\n"
    if serving.max_model_len < SHORT_CONTEXT_TOKENS and serving.is_kv_bound:
        lines += f"  warning    : that is all {_kv_cache_size(cluster)} holds; raise {_kv_cache_knob()} for longer requests\n"
    elif serving.max_model_len < SHORT_CONTEXT_TOKENS:
        lines += "  note       : that is the model's own context length (its config.json)\n"
    for instance_id in serving.drained:
        lines += (f"  drained    : {instance_id} (its mark is kept in etcd; "
                  f"`{_ctl_command(cluster, 'drain', instance_id, '--undo')}` takes it back)\n")
    for instance_id, role in serving.roles_set:
        lines += (f"  role       : {instance_id} is {role}, set at runtime (kept in etcd; "
                  f"`{_ctl_command(cluster, 'role', instance_id, '<its --role>')}` removes the mark)\n")
    return lines


def _kv_cache_size(cluster: LocalCluster) -> str:
    if NUM_BLOCKS_VARIABLE in os.environ:
        return f"a KV cache of {os.environ[NUM_BLOCKS_VARIABLE]} blocks ({NUM_BLOCKS_VARIABLE})"
    return f"a {cluster.spec.kv_cache_mib} MiB KV cache"


def _kv_cache_knob() -> str:
    return NUM_BLOCKS_VARIABLE if NUM_BLOCKS_VARIABLE in os.environ else "--kv-cache-mib"


NUM_BLOCKS_VARIABLE = "FERRY_INSTANCE_NUM_BLOCKS"  # the instances' --num-blocks, which overrides --kv-cache-mib


def _engine_note(cluster: LocalCluster) -> str:
    if cluster.spec.engine == "sim":
        return ", sim engine: a latency model, no forward pass, so answers are random tokens"
    return ""


def ready_banner(cluster: LocalCluster, serving: Serving | None = None) -> str:
    """What `up` prints once every child is healthy; its commands work as printed (from the repository root)."""
    model = cluster.spec.model_dir.name
    security = cluster.spec.security
    address = cluster.admin_address
    grpcurl = shlex.join(["grpcurl", *security.grpcurl_args()])
    token = f'-H "authorization: Bearer $(cat {shlex.quote(str(security.admin_token_file))})" ' \
        if security.has_admin_token else ""  # read at run time: the token itself is never printed
    ctl = _ctl_command(cluster, "instances")
    return f"""
ferry cluster is up ({len(cluster.spec.roles)} instance{"" if len(cluster.spec.roles) == 1 else "s"}, model {model}{_engine_note(cluster)})
  OpenAI API : {cluster.frontend_url}/v1
  admin gRPC : {address}   ({grpcurl} {address} list)
  security   : {_security_line(security)}
  etcd       : {cluster.etcd.endpoint}   (plaintext, loopback only)
  state file : {cluster.state_dir / 'cluster.json'}   (every process with its pid, address and metrics_url)
  logs       : {cluster.state_dir / 'logs'}
{_serving_lines(cluster, serving)}
try:{_activate_hint()}
  curl -s {cluster.frontend_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'
  {grpcurl} {token}{address} ferry.v1.AdminService/ListInstances{_instance_example(cluster, grpcurl)}
  {ctl}

Ctrl-C stops everything.
ready"""


def _activate_hint() -> str:
    """Where this python is a virtualenv's that the shell would not find (`make run` runs .venv's
    python directly), the banner's `python` and `grpcurl` need that environment activated first."""
    venv_bin = pathlib.Path(sys.executable).parent
    if sys.prefix == sys.base_prefix or shutil.which("python") == str(venv_bin / "python"):
        return ""
    activate = venv_bin / "activate"
    with contextlib.suppress(ValueError):
        activate = activate.relative_to(pathlib.Path.cwd())
    return f"   (in a shell with its environment: source {shlex.quote(str(activate))})"


def _ctl_command(cluster: LocalCluster, *args: str) -> str:
    return shlex.join(["python", "-m", "services.ctl", "--admin", ",".join(cluster.admin_addresses),
                       *cluster.spec.security.ctl_args(), *args])


def _instance_example(cluster: LocalCluster, grpcurl: str) -> str:
    """With a cluster token, an InstanceService call that carries it (the token read at run time)."""
    instance = next((p for p in cluster.processes if p.name.startswith("instance-")), None)
    if not cluster.spec.security.has_cluster_token or instance is None:
        return ""
    return f"\n  {grpcurl} {cluster.spec.security.cluster_token_header()}{instance.address} ferry.v1.InstanceService/GetStatus"


def _security_line(security: ClusterSecurity) -> str:
    if not security.is_tls:
        tls = "gRPC in plaintext (--tls-ca/--tls-cert/--tls-key turn on TLS)"
    else:
        tls = f"{'mutual TLS' if security.is_mtls else 'TLS'} on every gRPC channel (CA {security.tls_ca})"
    token = "admin token required" if security.has_admin_token else "admin API open (--admin-token-file closes it)"
    internal = ("cluster token required on internal services" if security.has_cluster_token
                else "internal services open (--cluster-token-file closes them)")
    return f"{tls}; {token}; {internal}"
