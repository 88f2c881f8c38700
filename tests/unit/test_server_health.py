"""A server's health service: NOT_SERVING from the moment its port answers until its role calls
set_serving, so that a launcher or a probe never routes to a coordinator whose HTTP front is not
listening yet (grpcio's servicer starts the server-wide status at SERVING)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc

from beamsplit.server.server_common import ShutdownGate, peer_channel, start_grpc_server


def test_the_server_is_not_serving_until_its_role_says_so() -> None:
    server = start_grpc_server("127.0.0.1", 0, lambda grpc_server: None, ShutdownGate())
    try:
        with peer_channel(f"127.0.0.1:{server.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10.0).status

            assert status("") == health_pb2.HealthCheckResponse.NOT_SERVING
            server.set_serving(["beamsplit.Role"])
            assert status("") == status("beamsplit.Role") == health_pb2.HealthCheckResponse.SERVING
            server.set_serving(["beamsplit.Role"], is_serving=False)
            assert status("") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.server.stop(grace=None)
