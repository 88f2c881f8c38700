"""TLS settings of one process: its own certificate, the CA it trusts, whether it asks for client certs.

One `TlsConfig` serves both directions, the way a process has one identity:
- listening (gRPC port, HTTP front): `cert_path`/`key_path` make the listener TLS; with
  `require_client_cert` it also refuses a client that shows no certificate signed by `ca_path`
  (mutual TLS, meant for workers, whose only clients are the coordinator and generation workers);
- calling (coordinator -> workers, generation worker -> context worker, clients, launchers'
  health waits): `ca_path` makes the channel TLS, verifying the server against that CA, and the
  same `cert_path`/`key_path`, when given, are shown as the client certificate. Without
  `ca_path` the channel is plaintext.

Files are read once, when the credentials are made. The metrics endpoint and UCX are not covered
(docs/security.md).
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


class TlsConfigError(ValueError):
    """A flag combination that cannot work, or a file that cannot be read; the message names the flag."""


@dataclass(frozen=True)
class TlsConfig:
    cert_path: str | None = None  # PEM certificate chain of this process
    key_path: str | None = None  # its PEM private key
    ca_path: str | None = None  # PEM CA bundle: verifies servers we call (and clients, see below)
    require_client_cert: bool = False  # listeners refuse clients without a cert signed by ca_path

    def __post_init__(self) -> None:
        if (self.cert_path is None) != (self.key_path is None):
            raise TlsConfigError("--tls-cert and --tls-key go together")
        if self.require_client_cert and (self.ca_path is None or self.cert_path is None):
            raise TlsConfigError("--tls-require-client-cert needs --tls-cert, --tls-key and --tls-ca")
        for flag, path in (
            ("--tls-cert", self.cert_path),
            ("--tls-key", self.key_path),
            ("--tls-ca", self.ca_path),
        ):
            if path is not None and not Path(path).is_file():
                raise TlsConfigError(f"{flag} {path}: no such file")

    @property
    def is_server_tls(self) -> bool:
        return self.cert_path is not None

    @property
    def is_client_tls(self) -> bool:
        return self.ca_path is not None

    # -- listening -----------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.cert_path is not None and self.key_path is not None
        return grpc.ssl_server_credentials(
            [(_read(self.key_path), _read(self.cert_path))],
            root_certificates=_read(self.ca_path) if self.require_client_cert and self.ca_path else None,
            require_client_auth=self.require_client_cert,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments of `uvicorn.Config` for the HTTP front (empty: plaintext)."""
        if not self.is_server_tls:
            return {}
        options: dict[str, Any] = {"ssl_certfile": self.cert_path, "ssl_keyfile": self.key_path}
        if self.require_client_cert:
            options.update(ssl_ca_certs=self.ca_path, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options

    # -- calling -------------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None: call in plaintext (no --tls-ca)."""
        if self.ca_path is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_path),
            private_key=_read(self.key_path) if self.key_path else None,
            certificate_chain=_read(self.cert_path) if self.cert_path else None,
        )


def open_channel(address: str, tls: TlsConfig | None, options: Any = ()) -> grpc.Channel:
    """A TLS channel when `tls` has a CA, a plaintext one otherwise."""
    credentials = tls.channel_credentials() if tls is not None else None
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """None when no TLS flag is set."""
    config = TlsConfig(
        cert_path=getattr(args, "tls_cert", None),
        key_path=getattr(args, "tls_key", None),
        ca_path=getattr(args, "tls_ca", None),
        require_client_cert=bool(getattr(args, "tls_require_client_cert", False)),
    )
    return None if config == TlsConfig() else config


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise TlsConfigError(f"cannot read {path}: {error}") from error
