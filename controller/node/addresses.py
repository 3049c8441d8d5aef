"""This node's own IP addresses, as its agent registers them (the node record's `addresses`).

A rank that cannot reach a peer names the peer's address, not its node (gloo's
`remote=[10.231.1.12]:4431`, the TCPStore's `(10.231.0.10, 29500)`): the controller maps such an
address back to a node by what each node said it holds (controller/control/fabric.py). Every
interface's address is listed, the data network's among them, whatever the agent advertises:
loopback ones excepted (every host has them, so they name no node), at most MAX_ADDRESSES.
"""

from __future__ import annotations

import ipaddress

from controller.common.reach import interfaces

MAX_ADDRESSES = 32  # a host with more interfaces than this lists its first ones


def node_addresses() -> list[str]:
    """This host's IPv4 then IPv6 addresses (controller/common/reach.py `interfaces`), loopback
    left out, each once, at most MAX_ADDRESSES; [] when the kernel will not say."""
    try:
        found = interfaces()
    except OSError:
        return []
    v4, v6 = [], []
    for address in (a for addresses in found.values() for a in addresses):
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            continue
        if ip.is_loopback or ip.is_unspecified:
            continue
        (v4 if ip.version == 4 else v6).append(ip.compressed)
    return list(dict.fromkeys(v4 + v6))[:MAX_ADDRESSES]
