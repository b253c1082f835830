"""TLS, the admin token and the cluster token of a local cluster: which flags each child gets.

One certificate serves every gRPC service on this host (it must name 127.0.0.1 or
localhost, the address the launcher dials and the children advertise). With
`tls_client_ca` every gRPC server also requires client certificates (mTLS); the children
and the launcher's own health probes then present that same certificate. etcd stays
plaintext on loopback, and the frontend's OpenAI API stays plain HTTP.

The admin token and the cluster token only ever travel as file paths
(`--admin-token-file`, `--cluster-token-file`): a token itself never reaches a command
line, a log or cluster.json. The cluster token goes to every child (each sends it on its
internal calls, and each gRPC server but the admin API requires it); the launcher's own
health probes need none. `--cluster-token-file auto` has the launcher write a fresh random
one, readable by its user alone, to STATE_DIR/cluster.token when it starts.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import shlex
from dataclasses import dataclass, replace

from services.common.auth import read_token
from services.common.cluster_token import check_token
from services.common.tls import TlsConfig


GENERATED_TOKEN_NAME = "cluster.token"


@dataclass(frozen=True, slots=True)
class ClusterSecurity:
    """Absolute paths of PEM files and the token file; None means "not set"."""

    tls_ca: pathlib.Path | None = None  # verifies every server (and, under mTLS, every client)
    tls_cert: pathlib.Path | None = None  # each service's server certificate, and its client certificate
    tls_key: pathlib.Path | None = None  # private key of tls_cert
    tls_client_ca: pathlib.Path | None = None  # set = servers require client certificates (mTLS)
    admin_token_file: pathlib.Path | None = None  # handed to every manager as --admin-token-file
    cluster_token_file: pathlib.Path | None = None  # handed to every child as --cluster-token-file
    generates_cluster_token: bool = False  # --cluster-token-file auto: written at start (with_generated_cluster_token)

    @property
    def is_tls(self) -> bool:
        return self.tls_ca is not None

    @property
    def is_mtls(self) -> bool:
        return self.tls_client_ca is not None

    @property
    def has_admin_token(self) -> bool:
        return self.admin_token_file is not None

    @property
    def has_cluster_token(self) -> bool:
        return self.cluster_token_file is not None

    def check(self) -> None:
        """Raise ValueError (naming the flag) for a partial TLS setting or a missing file."""
        tls_flags = {"--tls-ca": self.tls_ca, "--tls-cert": self.tls_cert, "--tls-key": self.tls_key}
        missing = [flag for flag, path in tls_flags.items() if path is None]
        if 0 < len(missing) < len(tls_flags):
            raise ValueError(f"--tls-ca, --tls-cert and --tls-key go together (one certificate for every service); "
                             f"missing {' and '.join(missing)}")
        if self.is_mtls and not self.is_tls:
            raise ValueError("--tls-client-ca (mTLS) needs TLS: also pass --tls-ca, --tls-cert and --tls-key")
        self.tls_config().check()
        if self.admin_token_file is not None:
            read_token("", str(self.admin_token_file), "admin-token")  # exists, readable, not empty
        if self.cluster_token_file is not None:
            check_token(read_token("", str(self.cluster_token_file), "cluster-token"))

    def with_generated_cluster_token(self, state_dir: pathlib.Path) -> ClusterSecurity:
        """A fresh random token in STATE_DIR/cluster.token (mode 0600), which becomes the cluster token file."""
        path = state_dir / GENERATED_TOKEN_NAME
        path.unlink(missing_ok=True)  # O_EXCL below: never written through a link left in its place
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as token_file:
            token_file.write(secrets.token_hex(32) + "\n")
        return replace(self, cluster_token_file=path, generates_cluster_token=False)

    def tls_config(self) -> TlsConfig:
        """How the launcher's health probes (and the children) dial: our certificate included for mTLS."""
        return TlsConfig(cert_file=_str(self.tls_cert), key_file=_str(self.tls_key), ca_file=_str(self.tls_ca),
                         client_ca_file=_str(self.tls_client_ca))

    def dial_tls(self) -> TlsConfig | None:
        """What the launcher's own gRPC calls dial with: `tls_config()` under TLS, else plaintext (None)."""
        return self.tls_config() if self.is_tls else None

    def admin_token(self) -> str:
        """The admin token the launcher's own admin calls send ("" without one)."""
        return read_token("", str(self.admin_token_file), "admin-token") if self.has_admin_token else ""

    def client_args(self) -> list[str]:
        """TLS and cluster-token flags of a process that only dials gRPC servers (the frontend)."""
        token = ["--cluster-token-file", str(self.cluster_token_file)] if self.has_cluster_token else []
        if not self.is_tls:
            return token
        return ["--tls-ca", str(self.tls_ca), "--tls-cert", str(self.tls_cert), "--tls-key", str(self.tls_key), *token]

    def server_args(self) -> list[str]:
        """TLS flags of a process with a gRPC server (transfer, instance)."""
        mtls = ["--tls-client-ca", str(self.tls_client_ca)] if self.is_mtls else []
        return [*self.client_args(), *mtls]

    def manager_args(self) -> list[str]:
        token = ["--admin-token-file", str(self.admin_token_file)] if self.has_admin_token else []
        return [*self.server_args(), *token]

    def state(self) -> dict:
        """What cluster.json records, so tools know how to connect (paths only, never the token)."""
        return {"tls": self.is_tls, "tls_ca": _str(self.tls_ca), "mtls": self.is_mtls,
                "tls_cert": _str(self.tls_cert) if self.is_mtls else "",
                "tls_key": _str(self.tls_key) if self.is_mtls else "",
                "admin_token_file": _str(self.admin_token_file), "cluster_token_file": _str(self.cluster_token_file)}

    def grpcurl_args(self) -> list[str]:
        """grpcurl's connection flags: `-plaintext`, or the CA and, under mTLS, our certificate."""
        if not self.is_tls:
            return ["-plaintext"]
        mtls = ["-cert", str(self.tls_cert), "-key", str(self.tls_key)] if self.is_mtls else []
        return ["-cacert", str(self.tls_ca), *mtls]

    def cluster_token_header(self) -> str:
        """grpcurl's `-H` for InstanceService/TransferService calls (the token read at run time, never printed)."""
        if not self.has_cluster_token:
            return ""
        return f'-H "ferry-cluster-token: $(cat {shlex.quote(str(self.cluster_token_file))})" '

    def ctl_args(self) -> list[str]:
        """ferryctl's flags for the same connection (the token as its file)."""
        tls = ["--tls-ca", str(self.tls_ca)] if self.is_tls else []
        mtls = ["--tls-cert", str(self.tls_cert), "--tls-key", str(self.tls_key)] if self.is_mtls else []
        token = ["--token-file", str(self.admin_token_file)] if self.has_admin_token else []
        return [*tls, *mtls, *token]


def _str(path: pathlib.Path | None) -> str:
    return str(path) if path is not None else ""
