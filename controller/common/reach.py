"""Where other hosts reach this node, and whether they can.

A node is reached at the address its agent advertises (`optimus agent --host`), or at the
address of the interface it names (`--interface`), or else at this machine's hostname, which
Debian and Ubuntu map to 127.0.1.1 in /etc/hosts. An address that resolves to loopback reaches
nothing but this machine's own network namespace: rank 0's rendezvous there, or a snapshot link,
fails for every other host ("Connection refused, remote=[127.0.1.1]") and every generation hangs.

Whether two agents share a loopback is a fact of where they run: the same machine (its boot id)
and the same network namespace (the inode of /proc/self/ns/net). `machine()` says it at
registration; `isolated()` names an agent advertising loopback while another of the job runs
elsewhere, with the one line an operator needs. On one machine (`optimus run`, simulated nodes)
every agent shares it, and loopback is right.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import psutil

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
NETNS = "/proc/self/ns/net"
FIX = ("advertise an address the other hosts reach: `optimus agent --host ADDR` (or "
       "OPTIMUS_HOST), or `--interface IF` (OPTIMUS_INTERFACE) for the address of the interface "
       "the ranks use (docs/deploy.md, \"Addresses\")")


def machine() -> str:
    """This host and network namespace: equal for two agents exactly when they share a
    loopback interface."""
    try:
        boot = BOOT_ID.read_text()[:64].strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat(NETNS).st_ino
    except OSError:
        netns = 0
    return f"{boot}/{netns}"


def loopback(host: str) -> str:
    """The loopback address `host` is (or resolves to) here, or "" when it is none: the one
    other hosts would be told to connect to."""
    try:
        return host if ipaddress.ip_address(host).is_loopback else ""
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return ""  # unresolvable here: not loopback (the ranks' rendezvous will say so)
    addresses = [info[4][0] for info in found]
    # The first address is the one a connect tries first; one loopback among them is enough
    # to send the ranks' rendezvous there.
    return next((a for a in addresses if ipaddress.ip_address(a.split("%")[0]).is_loopback), "")


def interfaces() -> dict[str, list[str]]:
    """Each interface's IP addresses (IPv4 first), as the kernel lists them."""
    found: dict[str, list[str]] = {}
    for name, entries in psutil.net_if_addrs().items():
        v4 = [e.address for e in entries if e.family == socket.AF_INET]
        v6 = [e.address.split("%")[0] for e in entries if e.family == socket.AF_INET6]
        found[name] = v4 + v6
    return found


def interface_address(name: str) -> str:
    """The address of interface `name` (its first IPv4 one, else IPv6); ValueError naming
    the interfaces there are when it has none."""
    found = interfaces()
    if found.get(name):
        return found[name][0]
    with_one = sorted(n for n, a in found.items() if a)
    why = "has no IP address" if name in found else "is no interface of this host"
    raise ValueError(f"{name} {why}; this host's interfaces with an address: "
                     f"{', '.join(with_one) or 'none'}")


def isolated(node: str, info: Mapping, others: Mapping[str, Mapping]) -> str | None:
    """Why `node` (its registration `info`) cannot be reached by the job's other nodes, or
    None: it advertises a loopback address while another node runs on another machine or in
    another network namespace. Nodes that say no `machine` (an older agent) are not judged."""
    here, address = info.get("machine"), info.get("loopback")
    if not here or not address or not isinstance(address, str):
        return None
    # The first other machine found will do: O(1) for a node on a cluster, and a machine of
    # simulated nodes (all on one) is small.
    elsewhere = next((n for n, i in others.items()
                      if n != node and isinstance(i, Mapping) and i.get("machine")
                      and i.get("machine") != here), None)
    if elsewhere is None:
        return None
    return (f"node {node} advertises host {str(info.get('host', ''))[:253]!r}, which resolves "
            f"to {address[:64]} (loopback) on its machine, while {elsewhere} runs on "
            f"another: no other host can reach its ranks or its snapshot link; {FIX}")
