"""The committed stubs in beamsplit/v1/ are exactly what grpcio-tools makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = REPO_ROOT / "beamsplit" / "v1"


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        cwd=REPO_ROOT,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    fresh_dir = tmp_path / "beamsplit" / "v1"
    fresh = {path.name: path.read_text() for path in fresh_dir.iterdir() if path.is_file()}
    committed = {path.name: path.read_text() for path in STUB_DIR.iterdir() if path.is_file()}
    assert sorted(fresh) == sorted(committed), "stub files differ: run scripts/gen_proto.sh"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run scripts/gen_proto.sh and commit the result"


def test_every_proto_has_stubs() -> None:
    proto_names = {path.stem for path in (REPO_ROOT / "proto" / "beamsplit" / "v1").glob("*.proto")}
    for name in proto_names:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (STUB_DIR / f"{name}{suffix}").is_file(), f"missing beamsplit/v1/{name}{suffix}"


def test_handoff_round_trips_every_field() -> None:
    from beamsplit.v1 import worker_pb2

    handoff = worker_pb2.Handoff(
        request_id="r",
        transfer_id="r-0-abc",
        ucx_address="127.0.0.1:1234",
        context_address="127.0.0.1:50051",
        layout=worker_pb2.PageLayout(region="kv", tokens_per_block=32, page_bytes=4096, dtype="float64"),
        page_ids=[3, 4, 5],
        prompt_len=67,
        candidate_ids=[7, 9],
        candidate_logprobs=[-0.5, -1.25],
        secret="s",
        lease_deadline_unix_ms=123,
        reused_tokens=32,
    )
    decoded = worker_pb2.Handoff.FromString(handoff.SerializeToString())
    assert decoded == handoff
    assert list(decoded.candidate_logprobs) == [-0.5, -1.25]
