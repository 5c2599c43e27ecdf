"""The network interface a transfer to an address leaves by: where UCX may listen."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915


def host_of(address: str) -> str:
    """The host of HOST:PORT, [V6]:PORT, or a bare host."""
    if address.startswith("["):
        return address[1 : address.index("]")]
    host, sep, port = address.rpartition(":")
    return host if sep and port.isdigit() and ":" not in host else address


def local_address(peer: str) -> str:
    """The address of this host that a packet to `peer` (an IP) leaves from."""
    family = socket.AF_INET6 if ipaddress.ip_address(peer).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        # A datagram socket's connect only asks the routing table: nothing is sent.
        s.connect((peer, 9))
        return str(s.getsockname()[0])


def interface_of(peer: str) -> str:
    """The name of the interface holding the address a transfer to `peer` leaves from.

    `peer`: an IP, or HOST:PORT with a numeric host. Raises OSError when no route
    leads there or no interface holds that address.
    """
    ip = ipaddress.ip_address(local_address(host_of(peer)))
    for _, name in socket.if_nameindex():
        if ip in _addresses(name):
            return name
    raise OSError(f"no network interface holds {ip}, the address that reaches {peer}")


def _addresses(name: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            found.append(ipaddress.IPv4Address(packed[20:24]))
        except OSError:
            pass  # no IPv4 address on it
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if fields[-1] == name:
                    found.append(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    except OSError:
        pass  # no IPv6 here
    return found
