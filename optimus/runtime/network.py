"""Which network interface the ranks' collectives use, said once for every backend.

gloo, NCCL and oneCCL (and libfabric's TCP provider under it) each pick an interface by their
own rules when left alone; on a host with a management and a high-speed network, or whose name
resolves to loopback (Debian's /etc/hosts maps it to 127.0.1.1), they pick the wrong one and
the job hangs at its first rendezvous. The job (`network.interface`, or its site profile in
`jobs/sites/`) names the interface once; `collective_env` gives each library its own variable
for it, and the job's `network.env` adds site settings (CCL_*, FI_*, NCCL_*). A variable already
in the rank's environment wins: a node that names its interface otherwise (an agent's
`--interface`, a batch script) knows its own hardware. Nothing here touches torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

# Each library's variable for "use this interface" (an exact name for each: NCCL's `=` prefix
# matches the whole name, not a prefix of it).
INTERFACE_VARS = {
    "GLOO_SOCKET_IFNAME": "{}",
    "NCCL_SOCKET_IFNAME": "={}",
    "CCL_KVS_IFACE": "{}",  # oneCCL's key-value store (its rendezvous)
    "FI_TCP_IFACE": "{}",  # libfabric's TCP provider, under oneCCL
}
# An interface name as Linux allows it (IFNAMSIZ: 15 bytes; no '/', no whitespace).
INTERFACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}$")
# What `network.env` may set: a library's settings, never where a rank sits or whom it trusts.
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")
RESERVED = ("OPTIMUS_", "REDIS_", "MASTER_", "TORCHELASTIC_", "PMI", "SLURM_", "PALS_",
            "OMPI_", "PBS_")
RESERVED_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                  "GROUP_RANK", "PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "HOME")


def interface_env(interface: str) -> dict[str, str]:
    """Every collective library's variable naming `interface`."""
    return {name: form.format(interface) for name, form in INTERFACE_VARS.items()}


def env_problem(name: str) -> str | None:
    """Why `network.env` may not set `name`, or None."""
    if not ENV_NAME.match(name):
        return "not an environment variable name (capitals, digits and '_')"
    if name in RESERVED_NAMES or name.startswith(RESERVED):
        return ("reserved: the launcher, the agent or the system sets it, not the job "
                "(docs/deploy.md, \"The network\")")
    return None


def collective_env(interface: str | None, extra: Mapping[str, str],
                   environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to `environ` for the ranks' collectives: the interface's variables and the
    job's `extra`, less what `environ` already says."""
    wanted = {**(interface_env(interface) if interface else {}), **extra}
    return {k: v for k, v in wanted.items() if k not in environ}


def apply_network(network, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the job's network settings (`JobConfig.network`) in this process's environment
    before its first process group; what was set."""
    environ = os.environ if environ is None else environ
    added = collective_env(network.interface, network.env, environ)
    environ.update(added)
    return added
