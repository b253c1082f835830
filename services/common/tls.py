"""TLS for ferry's gRPC channels, configured once here and used by every service.

Each service config mixes in `TlsKnobs` (clients that serve nothing mix in
`ClientTlsKnobs`), which gives it the same flags and FERRY_<SVC>_TLS_* variables:

* `--tls-cert`/`--tls-key`: this process's certificate. Its gRPC server (if any) serves
  TLS with it, and its outbound channels present it when a server asks for a client
  certificate (mTLS).
* `--tls-client-ca`: the server requires client certificates signed by this CA (mTLS).
* `--tls-ca`: outbound channels use TLS and verify servers against this CA; empty means
  plaintext outbound channels.
* `--tls-server-name`: the name checked in server certificates, when it differs from the
  host dialed (certificates issued for a DNS name, dialed by IP).

A cluster either runs TLS everywhere (every process gets --tls-cert, --tls-key and
--tls-ca) or not at all; a plaintext client of a TLS server fails its handshake.

The ferry services' knobs (`TlsKnobs`, and `PeerKnobs` for the frontend, which serves no
gRPC) add the cluster token (services.common.cluster_token): `TlsConfig.cluster_token`
carries it to every channel and server this process opens, beside the TLS files.
ferryctl (`ClientTlsKnobs`) calls only the admin API and health, which do not need it.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import grpc

from services.common.cluster_token import CLUSTER_TOKEN_KEY, ClusterTokenKnobs
from services.common.config import knob


@dataclasses.dataclass(frozen=True, slots=True)
class TlsConfig:
    """How this process's gRPC connections are secured: paths of PEM files and the cluster token;
    empty strings mean "not set"."""

    cert_file: str = ""  # certificate chain this process presents (server, and client for mTLS)
    key_file: str = ""  # private key of cert_file
    client_ca_file: str = ""  # server side: require client certificates signed by this CA
    ca_file: str = ""  # client side: verify servers against this CA; set = outbound TLS on
    server_name: str = ""  # client side: expected name in server certificates (overrides the host)
    cluster_token: str = dataclasses.field(default="", repr=False)  # sent on every call; servers require it

    @property
    def is_server_tls(self) -> bool:
        return bool(self.cert_file)

    @property
    def is_client_tls(self) -> bool:
        return bool(self.ca_file)

    def check(self) -> None:
        """Raise ValueError (naming the flag) for half-set pairs and unreadable files."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("--tls-cert and --tls-key go together; set both or neither")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("--tls-client-ca (mTLS) needs a server certificate: set --tls-cert and --tls-key")
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file),
                           ("--tls-client-ca", self.client_ca_file), ("--tls-ca", self.ca_file)):
            if path and (problem := _file_problem(pathlib.Path(path))) is not None:
                raise ValueError(f"{flag} {path}: {problem}")


def _file_problem(path: pathlib.Path) -> str | None:
    """Why `path` cannot be read as a PEM file, or None."""
    if path.is_dir():
        return "is a directory; give the PEM file itself"
    if not path.is_file():
        return "no such file"
    return None


@dataclasses.dataclass(frozen=True)
class ClientTlsKnobs:
    """TLS flags of a process that only dials gRPC servers (mixed into its config dataclass)."""

    tls_ca: str = knob("", "PEM CA bundle that verifies the gRPC servers this process dials; set = TLS on outbound "
                           "channels, empty = plaintext")
    tls_cert: str = knob("", "PEM client certificate of this process, presented when a server requires one (mTLS)")
    tls_key: str = knob("", "PEM private key of --tls-cert")
    tls_server_name: str = knob("", "name expected in server certificates when it differs from the host dialed")

    @property
    def tls(self) -> TlsConfig:
        return TlsConfig(cert_file=self.tls_cert, key_file=self.tls_key, ca_file=self.tls_ca,
                         server_name=self.tls_server_name)


@dataclasses.dataclass(frozen=True)
class PeerKnobs(ClusterTokenKnobs, ClientTlsKnobs):
    """TLS and cluster-token flags of a ferry process that dials ferry's internal services (the frontend)."""

    @property
    def tls(self) -> TlsConfig:
        return dataclasses.replace(ClientTlsKnobs.tls.fget(self), cluster_token=self.resolved_cluster_token)


@dataclasses.dataclass(frozen=True)
class TlsKnobs(PeerKnobs):
    """TLS and cluster-token flags of a process with a gRPC server (mixed into its config dataclass)."""

    cluster_token: str = knob("", "shared secret of ferry's internal gRPC services: sent on every call to them "
                                  f"(`{CLUSTER_TOKEN_KEY}` metadata) and required by this process's gRPC server "
                                  "(the manager's AdminService excepted); empty = off. Prefer --cluster-token-file")

    tls_cert: str = knob("", "PEM certificate of this process: served by its gRPC server (TLS) and presented as "
                             "client certificate when a server requires one (mTLS); empty = plaintext server")
    tls_client_ca: str = knob("", "PEM CA bundle; when set, the gRPC server requires client certificates signed by "
                                  "it (mTLS); needs --tls-cert")

    @property
    def tls(self) -> TlsConfig:
        return dataclasses.replace(PeerKnobs.tls.fget(self), client_ca_file=self.tls_client_ca)


def make_server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """Credentials for `add_secure_port`, or None for a plaintext server."""
    if not tls.is_server_tls:
        return None
    client_ca = _read(tls.client_ca_file) if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(_read(tls.key_file), _read(tls.cert_file))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


@functools.lru_cache(maxsize=8)
def make_channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Credentials of an outbound TLS channel (our certificate included, for mTLS, when we have one)."""
    if not tls.is_client_tls:
        raise ValueError("outbound TLS needs --tls-ca")
    has_cert = tls.is_server_tls
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file),
                                        private_key=_read(tls.key_file) if has_cert else None,
                                        certificate_chain=_read(tls.cert_file) if has_cert else None)


def _read(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()
