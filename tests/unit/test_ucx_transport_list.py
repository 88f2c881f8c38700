"""transport_list: every UCX context of ours leaves out the shared-memory FIFO transports, whatever
UCX_TLS asks for (docs/transfer.md, "A killed peer must not stall the survivor")."""

from __future__ import annotations

import pytest

from transfer.ucx_binding import context_config, transport_list

FIFO_LESS = "^posix,sysv,xpmem"


@pytest.mark.parametrize(
    ("requested", "expected"),
    [
        (None, FIFO_LESS),
        ("", FIFO_LESS),
        ("all", FIFO_LESS),
        ("^ib", "^ib,posix,sysv,xpmem"),
        ("^sysv,tcp", "^sysv,tcp,posix,xpmem"),
        ("tcp", "tcp"),
        ("tcp,cma,self", "tcp,cma,self"),
        ("cuda_ipc,cuda_copy,sm,tcp,self", "cuda_ipc,cuda_copy,cma,tcp,self"),  # deploy/'s GPU list
        ("shm,cma,tcp", "cma,tcp"),
        ("posix,sysv,mm,tcp,self", "tcp,self"),
        ("tcp,all", FIFO_LESS),
        (" tcp , self ", "tcp,self"),
    ],
)
def test_fifo_transports_are_left_out(requested: str | None, expected: str) -> None:
    assert transport_list(requested) == expected


@pytest.mark.parametrize("requested", ["posix", "sysv,mm", "xpmem"])
def test_a_list_of_only_fifo_transports_is_refused_naming_the_variable(requested: str) -> None:
    with pytest.raises(ValueError, match="UCX_TLS"):
        transport_list(requested)


def test_context_config_carries_the_transports_with_the_other_settings() -> None:
    config = context_config("lo", "sm,tcp,self")
    assert config["TLS"] == "cma,tcp,self"
    assert config["NET_DEVICES"] == "lo"
    assert config["PROTO_INDIRECT_ID"] == "on"
    assert "NET_DEVICES" not in context_config(None, None)
