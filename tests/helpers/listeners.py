"""The addresses a process listens on, read from /proc (Linux): TCP sockets in LISTEN and bound
UDP sockets, IPv4 and IPv6, matched to the process by socket inode."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

_TCP_LISTEN = "0A"
_UDP_UNCONNECTED = "07"


def listening_addresses(pid: int) -> list[tuple[str, str, int]]:
    """(protocol, ip, port) of every socket of `pid` that accepts connections or datagrams."""
    inodes = _socket_inodes(pid)
    found: list[tuple[str, str, int]] = []
    for protocol, state in (("tcp", _TCP_LISTEN), ("tcp6", _TCP_LISTEN), ("udp", _UDP_UNCONNECTED), ("udp6", _UDP_UNCONNECTED)):  # fmt: skip
        table = Path(f"/proc/{pid}/net/{protocol}")
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            local, socket_state, inode = fields[1], fields[3], fields[9]
            if socket_state != state or inode not in inodes:
                continue
            ip_hex, port_hex = local.split(":")
            found.append((protocol, _ip(ip_hex), int(port_hex, 16)))
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _ip(hex_text: str) -> str:
    """/proc/net/tcp writes addresses as host-order 32-bit words in hex."""
    raw = bytes.fromhex(hex_text)
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = struct.pack(f">{len(words)}I", *words)
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, packed)
