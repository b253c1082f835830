"""`python -m services.cluster up`: a whole ferry cluster on this machine.

Starts a local etcd, the manager, the instances and the frontend as child
processes, waits until each is healthy, writes STATE_DIR/cluster.json, prints
`ready`, and stops every child on Ctrl-C / SIGTERM.

Security is off by default; the security flags of `up` (see `up --help`) turn on TLS
(or mutual TLS) on every gRPC channel, an admin token on the managers and a cluster
token on every internal service, e.g.

  python -m services.cluster up --tls-ca ca.pem --tls-cert cert.pem --tls-key key.pem \\
      --tls-client-ca ca.pem --admin-token-file admin.token --cluster-token-file cluster.token
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys

import structlog

from services.cluster.frontend_flags import check_frontend_words, frontend_words, launcher_set_flag
from services.cluster.launcher import TRANSFER_THREADS, ClusterSpec, LocalCluster, PortInUse, run_until_signalled
from services.cluster.outputs import forgive_broken_outputs
from services.cluster.processes import ROOT, ProcessDied, TlsRejected
from services.cluster.security import ClusterSecurity
from services.cluster.supervisor import RestartPolicy
from services.cluster.state_dir import StateDirInUse, StateDirUnusable
from services.common.config import DefaultsHelpFormatter, OneLineErrorParser
from services.common.etcd_launcher import EtcdStartFailed
from services.common.ids import check_cluster_flag
from services.common.logging import LogFormat, setup_logging

log = structlog.get_logger(__name__)

DEFAULT_MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"
VLLM_NOT_BUILT = ("--engine vllm is not built yet: live migration reads and writes an engine's block tables and KV "
                  "tensors, which vLLM keeps inside its scheduler and workers, and a resumed seeded request must draw "
                  "the same tokens, which vLLM's sampling does not promise; use --engine torch (CPU, or --device cuda) "
                  "or --engine sim (README: 'Status and known gaps')")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m services.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start a local cluster and run until Ctrl-C",
                             formatter_class=DefaultsHelpFormatter)
    up.add_argument("--model", default="smollm2",
                    help="Hugging Face model folder, or 'smollm2' for the embedded SmolLM2-135M-Instruct "
                         f"(converted once into {DEFAULT_MODEL_DIR.relative_to(ROOT)})")
    up.add_argument("--instances", type=int, default=None,
                    help="number of instances with role 'both' (default 2, or 0 with --prefill/--decode-instances)")
    up.add_argument("--prefill-instances", type=int, default=0, help="instances with role 'prefill' (PD disaggregation)")
    up.add_argument("--decode-instances", type=int, default=0, help="instances with role 'decode' (PD disaggregation)")
    up.add_argument("--managers", type=int, default=1,
                    help="manager processes: the first becomes leader, the rest wait as standbys")
    up.add_argument("--engine", default="torch", choices=["torch", "sim", "vllm"],
                    help="inference engine of every instance: torch runs the model; sim runs the same scheduler, "
                         "KV cache and migration with a latency model instead of the forward pass (no weights, little "
                         "CPU: many instances on one machine; FERRY_INSTANCE_SIM_* variables set its latency model); "
                         "vllm is not built yet and is refused with the reason")
    up.add_argument("--transfer-backend", default="auto", choices=["auto", "grpc", "gloo", "nccl", "shm"],
                    help="how KV blocks move between instances during migration: auto copies directly between "
                         "the instances' shared memory (shm) when one transfer service maps both, as on this one "
                         "machine, and uses grpc otherwise; the others force one backend for every migration. "
                         "nccl starts a transfer service per instance, each on its instance's GPU (NCCL refuses "
                         "both ends of a pair on one GPU): it needs 2 or more CUDA devices")
    up.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the torch engine of every instance runs: cuda puts instance i on GPU i modulo the "
                         "GPUs visible, its KV cache in GPU memory that the transfer service maps through CUDA IPC")
    up.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="weights and KV cache dtype of every instance")
    up.add_argument("--http-port", type=int, default=8000, help="frontend's OpenAI-compatible HTTP port")
    up.add_argument("--http-host", default="127.0.0.1",
                    help="address the frontend listens on: this machine only by default, since the API has no "
                         "key unless the frontend is given one; 0.0.0.0 serves every interface (a container); "
                         "default 127.0.0.1")
    up.add_argument("--admin-port", type=int, default=50051, help="manager's gRPC port (ManagerService + AdminService)")
    up.add_argument("--state-dir", type=pathlib.Path, default=None,
                    help="where cluster.json, logs and etcd data go (default: a temp dir removed on exit)")
    up.add_argument("--cluster", default="ferry", help="cluster name (etcd keys live under /ferry/<cluster>/)")
    up.add_argument("--threads-per-instance", type=int, default=0,
                    help="torch threads per instance (0 = cores / instances, at least 1)")
    up.add_argument("--transfer-threads", type=int, default=TRANSFER_THREADS,
                    help="torch threads of each transfer service, for its gathers, scatters and same-host copies "
                         "(0 = as many as torch picks: one per core, contending with the instances' threads)")
    up.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache per instance in MiB")
    up.add_argument("--log-format", default="console", choices=["console", "json"],
                    help="log format of every process (the launcher's banner and `ready` line on stdout stay text)")
    up.add_argument("--autoscale-max-instances", type=int, default=0, metavar="N",
                    help="let the leader manager scale between --instances and N instances, keeping the average "
                         "freeness in its band (ferryctl policy set --set scaling_low_freeness=... changes it); "
                         "0 = off. Not with --prefill/--decode-instances")
    up.add_argument("--restart", default="on-failure", choices=["on-failure", "no"],
                    help="what happens to a child (etcd, a manager, transfer service, instance, frontend) that fails (exits "
                         "with a status other than 0; SIGTERM makes a service exit 0): on-failure starts it again "
                         "with the same port and id, waiting 1 s, then twice as "
                         "long each time (at most 30 s), at most 5 times in 5 minutes, after which it stays down "
                         "(as systemd's Restart=on-failure); no only reports it")
    up.add_argument("--health-timeout-s", type=float, default=180.0, metavar="S",
                    help="how long each child (etcd aside) may take to answer its health check, at start and when "
                         "scaling adds an instance; one still not healthy then makes `up` fail, naming it (raise it "
                         "for a model that loads slowly: the systemd instance unit allows 900 s)")
    up.add_argument("--frontend-arg", action="append", default=[], metavar="'--FLAG VALUE'",
                    help="flags for the frontend, as `python -m services.frontend --help` lists them (e.g. "
                         "--frontend-arg='--api-key K1' --frontend-arg=--generation-config=vllm); repeat it; each "
                         "value is split into words as a shell would. Checked before anything starts: a flag the "
                         "frontend does not take, a bad value or one the launcher sets itself (--port: use "
                         "--http-port) is a usage error naming it")
    _add_security_arguments(up)
    args = parser.parse_args(argv)
    if args.engine == "vllm":
        up.error(VLLM_NOT_BUILT)
    if args.instances is None:
        args.instances = 0 if args.prefill_instances or args.decode_instances else 2
    if args.instances < 0 or args.prefill_instances < 0 or args.decode_instances < 0:
        up.error("--instances, --prefill-instances and --decode-instances must be >= 0")
    if args.managers < 1:
        up.error("--managers must be at least 1")
    if args.autoscale_max_instances and (args.prefill_instances or args.decode_instances):
        up.error("--autoscale-max-instances scales 'both' instances only; drop --prefill/--decode-instances")
    if args.autoscale_max_instances and args.autoscale_max_instances < args.instances:
        up.error(f"--autoscale-max-instances must be at least --instances ({args.instances}) or 0")
    for flag, port in (("--http-port", args.http_port), ("--admin-port", args.admin_port)):
        if not 1 <= port <= 65535:
            up.error(f"{flag} must be a port number 1..65535, got {port}")
    if args.http_port == args.admin_port:
        up.error(f"--http-port and --admin-port must differ (both are {args.http_port})")
    if not args.health_timeout_s > 0:  # NaN too
        up.error(f"--health-timeout-s must be positive, got {args.health_timeout_s:g}")
    try:
        check_cluster_flag(args.cluster)
    except ValueError as exc:
        up.error(str(exc))
    if args.kv_cache_mib <= 0:
        up.error(f"--kv-cache-mib must be positive, got {args.kv_cache_mib}")
    if args.threads_per_instance < 0:
        up.error(f"--threads-per-instance must be >= 0 (0 = cores / instances), got {args.threads_per_instance}")
    if args.transfer_threads < 0:
        up.error(f"--transfer-threads must be >= 0 (0 = torch's default), got {args.transfer_threads}")
    if args.transfer_backend == "nccl":
        _check_nccl_usable(up, args)
    if args.instances + args.prefill_instances + args.decode_instances == 0:
        up.error("the cluster needs at least one instance: pass --instances N or --prefill-instances/--decode-instances")
    try:
        args.security = security_from_args(args)
        args.frontend_arg = frontend_words(args.frontend_arg)
    except ValueError as exc:
        up.error(str(exc))
    if (launcher_set := launcher_set_flag(args.frontend_arg)) is not None:
        up.error(launcher_set)
    check_frontend_words(args.frontend_arg)
    return args


def _check_nccl_usable(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    import torch  # only here: the launcher itself never needs torch

    if torch.cuda.device_count() < 2:
        parser.error(f"--transfer-backend nccl needs 2 or more CUDA devices (each instance's transfer service "
                     f"uses its own GPU; NCCL refuses two on one), and {torch.cuda.device_count()} are visible; "
                     "use auto, grpc, gloo or shm")
    if args.autoscale_max_instances:
        parser.error("--autoscale-max-instances does not go with --transfer-backend nccl (an instance added by "
                     "scaling would have no transfer service of its own)")


def _add_security_arguments(up: argparse.ArgumentParser) -> None:
    group = up.add_argument_group(
        "security", "TLS on every gRPC channel, an admin token and a cluster token; all off by default. etcd stays plaintext on "
                    "loopback (it is never exposed) and the frontend's OpenAI API stays plain HTTP (put --http-port "
                    "behind a TLS proxy to expose it).")
    group.add_argument("--tls-ca", type=pathlib.Path, default=None, metavar="FILE",
                       help="PEM CA bundle every process verifies the gRPC servers it dials against; with --tls-cert "
                            "and --tls-key turns on TLS (all three or none)")
    group.add_argument("--tls-cert", type=pathlib.Path, default=None, metavar="FILE",
                       help="PEM certificate every gRPC service on this host serves (one for all; it must name "
                            "127.0.0.1 or localhost) and presents as its client certificate under mTLS")
    group.add_argument("--tls-key", type=pathlib.Path, default=None, metavar="FILE",
                       help="PEM private key of --tls-cert")
    group.add_argument("--tls-client-ca", type=pathlib.Path, default=None, metavar="FILE",
                       help="PEM CA bundle: every gRPC server requires client certificates signed by it (mutual TLS); "
                            "needs --tls-ca/--tls-cert/--tls-key")
    group.add_argument("--admin-token-file", type=pathlib.Path, default=None, metavar="FILE",
                       help="file holding the bearer token every AdminService call must carry (given to the managers "
                            "as --admin-token-file; the token never appears on a command line, in logs or in "
                            "cluster.json); ferryctl reads it with --token-file")
    group.add_argument("--cluster-token-file", default=None, metavar="FILE|auto",
                       help="file holding the cluster token (printable ASCII, e.g. `openssl rand -hex 32`), given to "
                            "every child as --cluster-token-file: each sends it on its internal gRPC calls and each "
                            "gRPC server (the admin API excepted) refuses calls without it; the token never appears "
                            "on a command line, in logs or in cluster.json. `auto`: a fresh random token in "
                            "STATE_DIR/cluster.token (mode 0600)")


def security_from_args(args: argparse.Namespace) -> ClusterSecurity:
    """The security flags as absolute paths (children run from the repository root); ValueError if unusable."""
    def absolute(path: pathlib.Path | None) -> pathlib.Path | None:
        return path.resolve() if path is not None else None

    generates_token = args.cluster_token_file == "auto"  # ./auto names a file called auto
    token_file = pathlib.Path(args.cluster_token_file) if args.cluster_token_file and not generates_token else None
    security = ClusterSecurity(tls_ca=absolute(args.tls_ca), tls_cert=absolute(args.tls_cert),
                               tls_key=absolute(args.tls_key), tls_client_ca=absolute(args.tls_client_ca),
                               admin_token_file=absolute(args.admin_token_file),
                               cluster_token_file=absolute(token_file),
                               generates_cluster_token=generates_token)
    security.check()
    return security


def resolve_model(model: str) -> pathlib.Path:
    if model != "smollm2":
        path = pathlib.Path(model)
        if not (path / "config.json").is_file():
            print(f"python -m services.cluster up: error: --model {model}: no config.json there; pass a Hugging Face "
                  "model folder or 'smollm2'", file=sys.stderr)
            sys.exit(2)  # a usage error, as argparse's
        return path.resolve()
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        from services.instance.models.smollm2 import import_smollm2
        import_smollm2(DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR


def build_spec(args: argparse.Namespace) -> ClusterSpec:
    roles = ("both",) * args.instances + ("prefill",) * args.prefill_instances + ("decode",) * args.decode_instances
    threads = args.threads_per_instance or max(1, (os.cpu_count() or 1) // len(roles))
    return ClusterSpec(model_dir=resolve_model(args.model), roles=roles, num_managers=args.managers, engine=args.engine,
                       transfer_backend=args.transfer_backend, http_port=args.http_port, admin_port=args.admin_port,
                       state_dir=args.state_dir.resolve() if args.state_dir else None, cluster=args.cluster,
                       threads_per_instance=threads, kv_cache_mib=args.kv_cache_mib, log_format=args.log_format,
                       security=args.security, autoscale_max_instances=args.autoscale_max_instances,
                       device=args.device, dtype=args.dtype, restart=RestartPolicy(on_failure=args.restart != "no"),
                       http_host=args.http_host, health_timeout_s=args.health_timeout_s,
                       frontend_args=args.frontend_arg, transfer_threads=args.transfer_threads)


def one_sided_pd(args: argparse.Namespace) -> str | None:
    """What a cluster with prefill instances and none that decode (or the reverse) will do, in words;
    None for a cluster with both kinds or none of either."""
    decoders = args.instances + args.decode_instances
    prefillers = args.instances + args.prefill_instances
    if args.prefill_instances and not decoders:
        return ("--prefill-instances without --decode-instances (or --instances): no instance decodes only, so "
                "every request decodes on the prefill instance that prefilled it (no PD hand-off)")
    if args.decode_instances and not prefillers:
        return ("--decode-instances without --prefill-instances (or --instances): no instance prefills, so "
                "every request is prefilled on a decode instance")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    forgive_broken_outputs()  # a closed terminal, or a pipe whose reader Ctrl-C ended, must not stop the stop
    setup_logging("cluster", LogFormat(args.log_format))
    if (one_sided := one_sided_pd(args)) is not None:
        log.warning("pd_one_sided", detail=one_sided)
    try:
        asyncio.run(run_until_signalled(LocalCluster(build_spec(args))))
    except (ProcessDied, TimeoutError, TlsRejected, PortInUse, StateDirInUse, StateDirUnusable,
            EtcdStartFailed) as exc:
        print(f"cluster failed to start: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. the state dir's disk is full
        print(f"cluster failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
