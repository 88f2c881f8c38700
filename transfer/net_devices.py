"""Which network interface holds an address, so UCX can be kept to the interface we were told to use.

Linux only (SIOCGIFADDR); anywhere else, or for an address no interface holds, the answer is None
and UCX keeps its own choice.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def interface_of(host: str) -> str | None:
    """The name of the interface holding `host`'s IPv4 address ("lo" for 127.0.0.1), or None."""
    if host in _WILDCARD_HOSTS:
        return None
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if address.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == str(address):
                return name
    return None
