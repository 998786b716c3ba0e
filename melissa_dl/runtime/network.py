"""Where a rank binds its sockets and what it tells clients to connect to (``server.interface``)."""

from __future__ import annotations

import fcntl
import socket
import struct

from melissa_dl.errors import ConfigError


def addresses(interface: str) -> tuple[str, str]:
    """The address to bind and the one clients connect to (``server.interface``): ``*`` binds every interface
    and advertises the host name; the name of a network interface (``eth0``, ``ib0``) binds and advertises
    that interface's IPv4 address on this rank's host, so ranks on several hosts each advertise their own;
    anything else is the address itself."""
    if interface in ("*", "0.0.0.0"):
        return "*", socket.gethostname()
    if interface in {name for _, name in socket.if_nameindex()}:
        address = interface_address(interface)
        if address is None:
            raise ConfigError(f"server.interface: {interface} has no IPv4 address on {socket.gethostname()}")
        return address, address
    return interface, interface


def interface_address(name: str) -> str | None:
    """The IPv4 address of the network interface ``name`` (None if it has none), as the kernel reports it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])  # the sockaddr_in's address, after the name and the family and port


SIOCGIFADDR = 0x8915  # linux/sockios.h
