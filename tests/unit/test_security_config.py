"""TLS and token settings: flag combinations that cannot work fail at start in one line naming the
flag, the token comes from its file before the environment, and the header check is exact."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from beamsplit.cli import main
from beamsplit.cli.security_args import TOKEN_ENV, AuthConfigError, bearer_metadata, load_token
from beamsplit.server.auth import is_authorized
from beamsplit.server.tls import TlsConfig, TlsConfigError, tls_from_args


def test_token_from_file_first_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_token(argparse.Namespace(auth_token_file=None)) is None
    monkeypatch.setenv(TOKEN_ENV, " from-env \n")
    assert load_token(argparse.Namespace(auth_token_file=None)) == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\nignored\n")
    assert load_token(argparse.Namespace(auth_token_file=str(token_file))) == "from-file"
    token_file.write_text("\n")
    with pytest.raises(AuthConfigError, match="holds no token"):
        load_token(argparse.Namespace(auth_token_file=str(token_file)))
    with pytest.raises(AuthConfigError, match="--auth-token-file .*missing"):
        load_token(argparse.Namespace(auth_token_file=str(tmp_path / "missing")))


def test_bearer_header_check() -> None:
    assert bearer_metadata("t") == (("authorization", "Bearer t"),)
    assert bearer_metadata(None) == ()
    assert is_authorized("Bearer t0k", "t0k") and is_authorized("bearer t0k", "t0k")
    for header in (None, "", "t0k", "Bearer", "Bearer t0", "Bearer t0kk", "Basic t0k"):
        assert not is_authorized(header, "t0k"), header


def test_tls_flag_combinations(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("not read until the credentials are made")
    assert tls_from_args(argparse.Namespace()) is None
    config = tls_from_args(argparse.Namespace(tls_cert=str(pem), tls_key=str(pem), tls_ca=None))
    assert config is not None and config.is_server_tls and not config.is_client_tls
    assert config.channel_credentials() is None  # no CA: calls stay plaintext
    with pytest.raises(TlsConfigError, match="go together"):
        TlsConfig(cert_path=str(pem))
    with pytest.raises(TlsConfigError, match="needs --tls-cert, --tls-key and --tls-ca"):
        TlsConfig(str(pem), str(pem), require_client_cert=True)
    with pytest.raises(TlsConfigError, match="--tls-ca .*no such file"):
        TlsConfig(ca_path=str(tmp_path / "missing.pem"))


def test_serve_with_a_missing_certificate_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "missing.pem")
    code = main(["serve", "coordinator", "--context", "127.0.0.1:1", "--generation", "127.0.0.1:2",
                 "--tls-cert", missing, "--tls-key", missing])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip() == f"[coordinator] error: --tls-cert {missing}: no such file"
