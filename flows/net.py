"""Network-address helpers shared by the servers ragline starts and the endpoints it reaches."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (also IPv4-mapped, with or without brackets), or the name ``localhost``.
    Not 0.0.0.0 or ``::``: they bind every interface, so a server there is reachable from the network."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)
