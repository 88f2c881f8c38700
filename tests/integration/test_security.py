"""Security of a deployment: loopback listeners by default, TLS, mutual TLS, the bearer token.

One deployment for the module (`tiny`, float64), every process started without `--host`:
- context and generation workers: a server certificate and mutual TLS (`--tls-require-client-cert`);
  the generation worker calls the context worker with its own certificate;
- coordinator: TLS on gRPC and HTTP, the CA and its certificate to reach the workers, a token;
- aggregated server: TLS on gRPC and HTTP and the same token, no CA.
Certificates are made here (`tests/helpers/certificates.py`). Every test that sends work ends with
every KV pool at zero blocks in use.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from beamsplit.cli import main
from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import HOST, ServerProcess
from beamsplit.launch.local_cluster import LocalCluster, start_local_cluster
from beamsplit.server.tls import TlsConfig, open_channel
from beamsplit.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from tests.helpers.certificates import Authority, CertificateFiles, make_authority
from tests.helpers.clusters import assert_pools_empty
from tests.helpers.listeners import is_loopback, listening_addresses

pytestmark = pytest.mark.timeout(240)
TOKEN = "s3cret-token-for-tests"
SAMPLING = common_pb2.SamplingOptions(beam_width=2, max_new_tokens=4)


@dataclass
class Deployment:
    cluster: LocalCluster
    authority: Authority
    server: CertificateFiles  # every server's certificate (also its client certificate)
    client: CertificateFiles  # a client certificate of the same CA
    stranger: CertificateFiles  # a certificate of another CA
    token_path: str

    @property
    def client_tls(self) -> TlsConfig:
        return TlsConfig(self.client.cert_path, self.client.key_path, self.authority.cert_path)

    @property
    def ca_only(self) -> TlsConfig:
        return TlsConfig(ca_path=self.authority.cert_path)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    directory: Path = tmp_path_factory.mktemp("security")
    authority = make_authority(directory / "ca")
    server = authority.issue(directory, "server")
    client = authority.issue(directory, "client")
    stranger = make_authority(directory / "other-ca", "other-ca").issue(directory, "stranger")
    token_path = directory / "token"
    token_path.write_text(TOKEN + "\n")
    certificate = ["--tls-cert", server.cert_path, "--tls-key", server.key_path]
    mutual = [*certificate, "--tls-ca", authority.cert_path, "--tls-require-client-cert"]
    token = ["--auth-token-file", str(token_path)]
    cluster = start_local_cluster(
        directory / "logs",
        startup_timeout_s=180.0,
        context_arguments=mutual,
        generation_arguments=mutual,
        coordinator_arguments=[*certificate, "--tls-ca", authority.cert_path, *token],
        aggregated_arguments=[*certificate, *token],
        http=True,
        client_tls=TlsConfig(client.cert_path, client.key_path, authority.cert_path),
    )
    try:
        yield Deployment(cluster, authority, server, client, stranger, str(token_path))
    finally:
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits {codes}; logs in {directory}"


def https_url(server: ServerProcess) -> str:
    return f"https://{HOST}:{server.http_port}/v1"


def test_every_listener_binds_loopback_by_default(deployment: Deployment) -> None:
    cluster = deployment.cluster
    with BeamsplitClient(cluster.coordinator.address, deployment.client_tls, TOKEN) as client:
        client.generate(build_request(token_ids=[1, 2, 3], sampling=SAMPLING))  # UCX endpoints wired up
    for server in (cluster.context, cluster.generation, cluster.coordinator, cluster.aggregated):
        listeners = listening_addresses(server.pid)
        ports = {port for _, _, port in listeners}
        expected = {server.port, server.metrics_port} | ({server.http_port} if server.http_port else set())
        assert expected <= ports, f"{server.name}: {expected - ports} not found in {listeners}"
        if server in (cluster.context, cluster.generation):
            assert len(ports) > len(expected), f"{server.name}: no UCX listener in {listeners}"
        exposed = [listener for listener in listeners if not is_loopback(listener[1])]
        assert not exposed, f"{server.name} listens beyond loopback: {exposed}"
    assert_pools_empty(cluster)


@pytest.mark.parametrize("role", ["coordinator", "aggregated"])
def test_grpc_needs_tls_and_the_token(deployment: Deployment, role: str) -> None:
    server: ServerProcess = getattr(deployment.cluster, role)
    request = build_request(token_ids=[5, 6, 7, 8], sampling=SAMPLING)
    with BeamsplitClient(server.address, deployment.ca_only, TOKEN) as client:
        result = client.generate(request, timeout_s=60.0)
    assert len(result.beams) == 2
    for tls, token, expected in [
        (None, TOKEN, grpc.StatusCode.UNAVAILABLE),  # plaintext against a TLS port
        (deployment.ca_only, None, grpc.StatusCode.UNAUTHENTICATED),
        (deployment.ca_only, "wrong-token", grpc.StatusCode.UNAUTHENTICATED),
    ]:
        with BeamsplitClient(server.address, tls, token) as client, pytest.raises(grpc.RpcError) as caught:
            client.generate(request, timeout_s=10.0)
        assert caught.value.code() == expected, (tls, token, caught.value.details())
    with open_channel(server.address, deployment.ca_only) as channel:
        status_call = coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus
        with pytest.raises(grpc.RpcError) as caught:
            status_call(coordinator_pb2.StatusRequest(), timeout=10.0)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in (caught.value.details() or "")
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10.0)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    assert_pools_empty(deployment.cluster)


def test_workers_refuse_channels_without_a_client_cert_of_the_ca(deployment: Deployment) -> None:
    cluster = deployment.cluster
    stranger = TlsConfig(
        deployment.stranger.cert_path, deployment.stranger.key_path, deployment.authority.cert_path
    )
    for server, stub_class in [
        (cluster.context, worker_pb2_grpc.ContextWorkerStub),
        (cluster.generation, worker_pb2_grpc.GenerationWorkerStub),
    ]:
        with open_channel(server.address, deployment.client_tls) as channel:
            info = stub_class(channel).GetInfo(common_pb2.WorkerInfoRequest(), timeout=10.0)
        assert info.model == "tiny"
        for tls in (None, deployment.ca_only, stranger):
            with open_channel(server.address, tls) as channel, pytest.raises(grpc.RpcError) as caught:
                stub_class(channel).GetInfo(common_pb2.WorkerInfoRequest(), timeout=5.0)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, (server.name, tls)
    # The coordinator reaches both workers with its certificate: every worker healthy in its status.
    with open_channel(cluster.coordinator.address, deployment.ca_only) as channel:
        status = coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(
            coordinator_pb2.StatusRequest(), timeout=10.0, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
    assert [worker.healthy for worker in status.workers] == [True, True]


@pytest.mark.parametrize("role", ["coordinator", "aggregated"])
def test_http_front_needs_tls_and_the_api_key(deployment: Deployment, role: str) -> None:
    server: ServerProcess = getattr(deployment.cluster, role)
    trusting = ssl.create_default_context(cafile=deployment.authority.cert_path)
    with httpx.Client(verify=trusting, timeout=60.0) as http:
        good = openai.OpenAI(base_url=https_url(server), api_key=TOKEN, max_retries=0, http_client=http)
        completion = good.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=3)
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        bad = openai.OpenAI(base_url=https_url(server), api_key="wrong", max_retries=0, http_client=http)
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=3)
        assert caught.value.status_code == 401
        assert caught.value.code == "invalid_api_key"
        for path in ("/models", "/completions"):  # no header at all; every route, even the model list
            response = http.request("GET" if path == "/models" else "POST", https_url(server) + path, json={})
            assert response.status_code == 401, response.text
            assert response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP against the TLS port
        httpx.get(f"http://{HOST}:{server.http_port}/v1/models", timeout=10.0)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust our CA
        httpx.get(https_url(server) + "/models", timeout=10.0)
    assert_pools_empty(deployment.cluster)


def test_cli_sends_ca_and_token(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    target = ["--target", deployment.cluster.coordinator.address, "--tls-ca", deployment.authority.cert_path]
    assert main(["generate", "--token-ids", "1,2,3", "--beam-width", "2", "--max-new-tokens", "2",
                 "--json", *target, "--auth-token-file", deployment.token_path]) == 0  # fmt: skip
    assert '"beams"' in capsys.readouterr().out
    assert main(["status", *target, "--auth-token-file", deployment.token_path]) == 0
    assert "2/2 workers healthy" in capsys.readouterr().out
    assert main(["status", *target]) == 1  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert_pools_empty(deployment.cluster)
