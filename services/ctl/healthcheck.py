"""`python -m services.ctl.healthcheck TARGET`: exit 0 if a ferry service is healthy, else 1.

For container and supervisor health checks (docker compose `healthcheck:`). TARGET is a
gRPC address `host:port` (asks `grpc.health.v1.Health/Check`, default service "") or an
HTTP base URL `http://host:port` (expects 200 from `GET /health`). Prints one line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.ctl.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="host:port (gRPC) or http://host:port (HTTP)")
    parser.add_argument("--service", default="", help="gRPC service name to check (default: the whole server)")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline in seconds (default: 2)")
    parser.add_argument("--tls-ca", default="", help="PEM CA bundle: check over TLS, verifying the server with it")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, when the server requires one (mTLS)")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default="", help="name expected in the server's certificate")
    args = parser.parse_args(argv)
    tls = TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca,
                    server_name=args.tls_server_name)
    if args.target.startswith(("http://", "https://")):
        status = http_status(args.target, args.timeout_s)
    else:
        status = asyncio.run(grpc_status(args.target, args.service, args.timeout_s, tls))
    print(f"{args.target}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
