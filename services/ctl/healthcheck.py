"""`python -m services.ctl.healthcheck TARGET`: exit 0 if a ferry service is healthy, else 1.

For container and supervisor health checks (docker compose `healthcheck:`). TARGET is a
gRPC address `host:port` (asks `grpc.health.v1.Health/Check`, default service "") or an
HTTP base URL `http://host:port` (expects 200 from `GET /health`). Prints one line.

Inside a service's container the TLS flags are not needed: they default to that
service's own `FERRY_<SERVICE>_TLS_CA/_CERT/_KEY/_SERVER_NAME` variables (the service
whose variables are set here; with several services' set, pass the flags).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import OneLineErrorParser
from services.common.grpc_server import secure_or_insecure_channel
from services.common.tls import TlsConfig


async def grpc_status(address: str, service: str, timeout_s: float, tls: TlsConfig | None = None) -> str:
    """The serving status name (SERVING, NOT_SERVING, ...) or the RPC error."""
    async with secure_or_insecure_channel(address, tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def http_status(base_url: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/health", timeout=timeout_s) as response:
            return "SERVING" if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return f"unreachable: {exc}"


_TLS_VARIABLE = re.compile(r"FERRY_([A-Z0-9]+)_TLS_(CA|CERT|KEY|SERVER_NAME)")


def tls_from_environment(env: Mapping[str, str]) -> dict[str, str]:
    """{field: value} of the one service whose FERRY_<SERVICE>_TLS_* variables are set in `env`."""
    by_service: dict[str, dict[str, str]] = {}
    for name, value in env.items():
        match = _TLS_VARIABLE.fullmatch(name)
        if match and value:
            by_service.setdefault(match.group(1), {})[match.group(2).lower()] = value
    if len(by_service) > 1:
        raise ValueError(f"TLS variables of several services are set ({', '.join(sorted(by_service))}); "
                         "pass --tls-ca/--tls-cert/--tls-key instead")
    return next(iter(by_service.values()), {})


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m services.ctl.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="host:port (gRPC) or http://host:port (HTTP)")
    parser.add_argument("--service", default="", help="gRPC service name to check (default: the whole server)")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline in seconds (default: 2)")
    parser.add_argument("--tls-ca", help="PEM CA bundle: check over TLS, verifying the server with it "
                                         "[default: FERRY_<SERVICE>_TLS_CA]")
    parser.add_argument("--tls-cert", help="PEM client certificate, when the server requires one (mTLS) "
                                           "[default: FERRY_<SERVICE>_TLS_CERT]")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert [default: FERRY_<SERVICE>_TLS_KEY]")
    parser.add_argument("--tls-server-name", help="name expected in the server's certificate "
                                                  "[default: FERRY_<SERVICE>_TLS_SERVER_NAME]")
    args = parser.parse_args(argv)
    try:
        tls = _tls_config(args, tls_from_environment(os.environ if env is None else env))
    except ValueError as exc:
        parser.error(str(exc))
    if args.target.startswith(("http://", "https://")):
        status = http_status(args.target, args.timeout_s)
    else:
        status = asyncio.run(grpc_status(args.target, args.service, args.timeout_s, tls))
    print(f"{args.target}: {status}")
    return 0 if status == "SERVING" else 1


def _tls_config(args: argparse.Namespace, from_env: Mapping[str, str]) -> TlsConfig:
    """Each --tls-* flag given, else this service's variable."""
    def setting(field: str) -> str:
        flag = getattr(args, f"tls_{field}")
        return from_env.get(field, "") if flag is None else flag
    return TlsConfig(ca_file=setting("ca"), cert_file=setting("cert"), key_file=setting("key"),
                     server_name=setting("server_name"))


if __name__ == "__main__":
    sys.exit(main())
