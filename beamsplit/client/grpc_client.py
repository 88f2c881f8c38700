"""A small client of the `Coordinator` API (coordinator or aggregated server alike), used by
`generate --target`, the demo and the tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from beamsplit.cli.security_args import bearer_metadata
from beamsplit.server.tls import TlsConfig, open_channel
from beamsplit.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from beamsplit.wire import apply_delta, beams_from_proto, stats_to_dict
from engine.types import Beam


@dataclass
class GenerateResult:
    request_id: str
    beams: list[Beam]
    texts: list[str]
    stats: dict[str, object]
    deltas: list[common_pb2.Delta] = field(default_factory=list)

    def streamed_beams(self) -> list[list[list[int]]]:
        """The live beams after each delta, rebuilt from the stream alone."""
        history: list[list[list[int]]] = []
        beams: list[list[int]] = []
        for delta in self.deltas:
            beams = apply_delta(beams, delta)
            history.append(beams)
        return history


def build_request(
    prompt: str | None = None,
    token_ids: list[int] | None = None,
    sampling: common_pb2.SamplingOptions | None = None,
    request_id: str = "",
    salt: bytes = b"",
) -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(request_id=request_id, salt=salt)
    if token_ids is not None:
        request.token_ids.CopyFrom(common_pb2.TokenIds(token_ids=token_ids))
    elif prompt is not None:
        request.text = prompt
    if sampling is not None:
        request.sampling.CopyFrom(sampling)
    return request


class BeamsplitClient:
    def __init__(self, target: str, tls: TlsConfig | None = None, auth_token: str | None = None) -> None:
        """`tls` with a CA: connect with TLS (and a client certificate when it has one);
        `auth_token`: sent as `authorization: Bearer` on every call (docs/security.md)."""
        self.target = target
        self._channel = open_channel(target, tls)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._metadata = bearer_metadata(auth_token)

    def stream(
        self, request: coordinator_pb2.GenerateRequest, timeout_s: float = 300.0
    ) -> Iterator[common_pb2.GenerateResponse]:
        return self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)  # type: ignore[no-any-return]

    def generate(self, request: coordinator_pb2.GenerateRequest, timeout_s: float = 300.0) -> GenerateResult:
        """Runs one request to its final message; raises grpc.RpcError on a failure status."""
        deltas: list[common_pb2.Delta] = []
        for response in self.stream(request, timeout_s):
            if response.HasField("delta"):
                deltas.append(response.delta)
            elif response.HasField("final"):
                return GenerateResult(
                    request_id=response.request_id,
                    beams=beams_from_proto(response.final.beams),
                    texts=[beam.text for beam in response.final.beams],
                    stats=stats_to_dict(response.final.stats),
                    deltas=deltas,
                )
        raise RuntimeError(f"{self.target}: the stream ended without a final result")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> BeamsplitClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
