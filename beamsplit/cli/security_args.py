"""TLS and bearer-token flags of the servers and the clients (docs/security.md), and the token's
loading. Kept free of grpc so that `--help` stays fast.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

TOKEN_ENV = "BEAMSPLIT_AUTH_TOKEN"


class AuthConfigError(ValueError):
    """The token file cannot be read or is empty; the message names it."""


def add_server_tls_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (docs/security.md)")
    group.add_argument("--tls-cert", default=None, help="PEM certificate: gRPC and HTTP listen with TLS only")
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA: calls to other beamsplit servers use TLS, verify them against it and show "
        "--tls-cert as the client certificate",
    )
    group.add_argument(
        "--tls-require-client-cert",
        action="store_true",
        help="mutual TLS: refuse clients without a certificate signed by --tls-ca (for workers)",
    )


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS and authentication (docs/security.md)")
    group.add_argument("--tls-ca", default=None, help="PEM CA: connect with TLS and verify the server")
    group.add_argument(
        "--tls-cert", default=None, help="PEM client certificate, for servers that ask for one"
    )
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    add_auth_arguments(group, is_server=False)


def add_auth_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, is_server: bool) -> None:
    verb = "require" if is_server else "send"
    parser.add_argument(
        "--auth-token-file",
        default=None,
        metavar="FILE",
        help=f"{verb} this bearer token (the first line of FILE); default: ${TOKEN_ENV} when set, else none",
    )


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `token` (empty without one)."""
    return () if token is None else (("authorization", f"Bearer {token}"),)


def load_token(args: argparse.Namespace) -> str | None:
    """The token from `--auth-token-file`, else from $BEAMSPLIT_AUTH_TOKEN; None when neither is set."""
    path = getattr(args, "auth_token_file", None)
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as error:
            raise AuthConfigError(f"--auth-token-file {path}: {error.strerror or error}") from error
        token = lines[0].strip() if lines else ""
        if not token:
            raise AuthConfigError(f"--auth-token-file {path}: the file holds no token")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None
