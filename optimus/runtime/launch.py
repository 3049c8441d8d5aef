"""One function that turns whatever launched this process into a `LaunchEnv`.

Launchers are tried in a fixed order: our own agent (OPTIMUS_*), torchrun, Slurm, PALS/PMIx
(Aurora's mpiexec), Open MPI, and finally a single process. Under another launcher an explicit
MASTER_ADDR or MASTER_PORT wins for the rendezvous address; under an agent the controller's
plan does (OPTIMUS_MASTER_ADDR/PORT: rank 0 moves with every generation, and a MASTER_ADDR
a batch template exported would point at where it was; the agent does not pass those on).
Nothing here touches torch.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from optimus.contract import env as names  # the local `env` reads the environment

DEFAULT_PORT = 29500
LOCALHOST = "127.0.0.1"


class LaunchError(ValueError):
    """The launch environment is missing a value or contradicts itself."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this rank sits in the world and how to find rank 0."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    job_id: str
    restart_count: int
    master_addr: str
    master_port: int
    launcher: str
    # The launcher already serves the TCPStore at master_addr:master_port (torchrun's
    # TORCHELASTIC_USE_AGENT_STORE), so every rank, rank 0 included, connects as a client.
    agent_store: bool = False


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Normalise the launch environment (os.environ by default) into a `LaunchEnv`."""
    env = _Reader(os.environ if environ is None else environ)
    found = next(((name, read) for name, detect, read in _LAUNCHERS if detect(env.environ)), None)
    launcher, read = found or ("single", _single)
    return _finish(env, launcher, read(env))


def cpu_binding(spec: str | None, local_rank: int) -> set[int] | None:
    """The CPUs this rank binds itself to, from OPTIMUS_CPU_BIND; None: no binding.

    The spec is what `mpiexec --cpu-bind list:` takes (`list:1-8:9-16:...`, one entry per
    local rank). Under an Optimus agent the launcher starts one agent per node, so it cannot
    bind the agent's ranks: each rank applies its own entry instead."""
    if not spec or spec == "none":
        return None
    entries = spec.removeprefix("list:").split(":")
    if not spec.startswith("list:") or local_rank >= len(entries):
        raise LaunchError(f"OPTIMUS_CPU_BIND={spec!r} has no entry for local rank {local_rank}; "
                          "fix: list:CPUS:CPUS:... with one entry per rank of a node, or none")
    cpus: set[int] = set()
    for part in entries[local_rank].split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit():
            raise LaunchError(f"OPTIMUS_CPU_BIND={spec!r}: {part!r} is not a CPU or a range")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list: "nid[001-003,010],login2" -> nid001 nid002 nid003 nid010 login2."""
    hosts: list[str] = []
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        hosts.extend(_expand_one(part.strip()))
    return hosts


def _expand_one(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if not match:
        return [pattern] if pattern else []
    head, tail = pattern[: match.start()], pattern[match.end() :]
    names = []
    for item in match.group(1).split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise LaunchError(f"cannot read host range [{match.group(1)}] in {pattern!r}")
        for number in range(int(lo), int(hi or lo) + 1):
            names.append(f"{head}{number:0{len(lo)}d}")
    return [name + rest for name in names for rest in _expand_one(tail) or [""]]


def expand_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's SLURM_TASKS_PER_NODE: "4(x2),3" -> [4, 4, 3]."""
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise LaunchError(f"SLURM_TASKS_PER_NODE={value!r} is not like '4(x2),3'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def derived_port(job_id: str) -> int:
    """A port in 20000..29999 that every rank of a job derives alike from its job id."""
    return 20000 + zlib.crc32(job_id.encode()) % 10000 if job_id else DEFAULT_PORT


class _Reader:
    """Reads variables and remembers which one gave each value, for error messages."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ
        self.source: dict[str, str] = {}

    def text(self, *names: str) -> str | None:
        for name in names:
            value = self.environ.get(name, "").strip()
            if value:
                return value
        return None

    def integer(self, field: str, *names: str, default: int | None = None, minimum: int = 0) -> int:
        for name in names:
            raw = self.environ.get(name, "").strip()
            if not raw:
                continue
            try:
                value = int(raw)
            except ValueError:
                raise LaunchError(f"{name}={raw!r} is not an integer") from None
            if value < minimum:
                raise LaunchError(f"{name}={value} must be at least {minimum}")
            self.source[field] = f"{name}={value}"
            return value
        if default is None:
            raise LaunchError(f"cannot tell the {field}: none of {', '.join(names)} is set")
        self.source[field] = f"{field}={default} (derived)"
        return default


def _agent(env: _Reader) -> dict:
    world = env.integer("world_size", names.WORLD_SIZE, minimum=1)
    rank = env.integer("rank", names.RANK)
    local_world = env.integer(
        "local_world_size", names.LOCAL_WORLD_SIZE, default=world, minimum=1
    )
    return dict(
        rank=rank,
        world_size=world,
        local_world_size=local_world,
        local_rank=env.integer("local_rank", names.LOCAL_RANK, default=rank % local_world),
        node_rank=env.integer("node_rank", names.NODE_RANK, default=rank // local_world),
        num_nodes=env.integer("num_nodes", names.NUM_NODES, default=-(-world // local_world)),
        job_id=env.text(names.JOB_ID),
        restart_count=env.integer("restart_count", names.GENERATION, default=0),
        master_addr=env.text(names.MASTER_ADDR),
        master_port=env.integer("master_port", names.MASTER_PORT, default=0, minimum=1),
    )


def _torchrun(env: _Reader) -> dict:
    world = env.integer("world_size", "WORLD_SIZE", minimum=1)
    rank = env.integer("rank", "RANK")
    local_world = env.integer("local_world_size", "LOCAL_WORLD_SIZE", default=world, minimum=1)
    return dict(
        rank=rank,
        world_size=world,
        local_world_size=local_world,
        local_rank=env.integer("local_rank", "LOCAL_RANK", default=rank % local_world),
        node_rank=env.integer("node_rank", "GROUP_RANK", default=rank // local_world),
        job_id=env.text("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID"),
        restart_count=env.integer("restart_count", "TORCHELASTIC_RESTART_COUNT", default=0),
        agent_store=env.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def _slurm(env: _Reader) -> dict:
    world = env.integer("world_size", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1)
    rank = env.integer("rank", "SLURM_PROCID")
    nodes = env.integer("num_nodes", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1, minimum=1)
    node = env.integer("node_rank", "SLURM_NODEID", default=0)
    per_node = env.text("SLURM_TASKS_PER_NODE")
    if per_node and "SLURM_NTASKS_PER_NODE" not in env.environ:
        counts = expand_tasks_per_node(per_node)
        if node >= len(counts):
            raise LaunchError(f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE={per_node!r}")
        local_default = counts[node]
    else:
        local_default = -(-world // nodes)
    local_world = env.integer(
        "local_world_size", "SLURM_NTASKS_PER_NODE", default=local_default, minimum=1
    )
    # A step may run on part of the allocation: its own node list comes first when present.
    nodelist = env.text("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    return dict(
        rank=rank,
        world_size=world,
        local_world_size=local_world,
        local_rank=env.integer("local_rank", "SLURM_LOCALID", default=rank % local_world),
        node_rank=node,
        num_nodes=nodes,
        job_id=env.text("SLURM_JOB_ID", "SLURM_JOBID"),
        restart_count=env.integer("restart_count", "SLURM_RESTART_COUNT", default=0),
        master_addr=expand_hostlist(nodelist)[0] if nodelist else None,
    )


def _pals(env: _Reader) -> dict:
    # What cray-pals mpiexec gives each rank, per HPE's PALS library header pals.h ("Environment
    # variables available for applications"): PALS_APID, PALS_RANKID, PALS_NODEID, PALS_DEPTH
    # (CPUs per rank, not a size), PALS_LOCAL_RANKID, PALS_LOCAL_SIZE, and for Cray PMI also
    # PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK, PMI_LOCAL_SIZE. There is no PALS world-size variable;
    # under --pmi=pmix ranks see PMIX_RANK, and PMI_SIZE may be absent. Then the world is
    # PALS_LOCAL_SIZE x the hosts in PBS_NODEFILE, assuming every allocated node runs ranks.
    hosts = _pbs_hosts(env)
    local_world = env.integer("local_world_size", "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", minimum=1)
    world_default = local_world * len(hosts) if hosts else None
    world = env.integer("world_size", "PMI_SIZE", default=world_default, minimum=1)
    rank = env.integer("rank", "PALS_RANKID", "PMIX_RANK", "PMI_RANK")
    return dict(
        rank=rank,
        world_size=world,
        local_world_size=local_world,
        local_rank=env.integer(
            "local_rank", "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", default=rank % local_world
        ),
        node_rank=env.integer("node_rank", "PALS_NODEID", default=rank // local_world),
        job_id=env.text("PBS_JOBID", "PALS_APID"),
        master_addr=hosts[0] if hosts else None,
    )


def _pbs_hosts(env: _Reader) -> list[str]:
    path = env.text("PBS_NODEFILE")
    if not path:
        return []
    try:
        with open(path) as file:
            lines = [line.strip() for line in file]
    except OSError as err:
        raise LaunchError(f"PBS_NODEFILE={path} cannot be read: {err.strerror}") from None
    return list(dict.fromkeys(line for line in lines if line))


def _openmpi(env: _Reader) -> dict:
    # OMPI_COMM_WORLD_NODE_RANK is this process's rank among the processes on its node across
    # all jobs, not the index of the node, so the node index is derived from the rank.
    world = env.integer("world_size", "OMPI_COMM_WORLD_SIZE", minimum=1)
    rank = env.integer("rank", "OMPI_COMM_WORLD_RANK")
    local_world = env.integer(
        "local_world_size", "OMPI_COMM_WORLD_LOCAL_SIZE", default=world, minimum=1
    )
    return dict(
        rank=rank,
        world_size=world,
        local_world_size=local_world,
        local_rank=env.integer(
            "local_rank", "OMPI_COMM_WORLD_LOCAL_RANK", default=rank % local_world
        ),
        node_rank=env.integer("node_rank", default=rank // local_world),
        job_id=env.text("SLURM_JOB_ID", "PBS_JOBID"),
    )


def _single(env: _Reader) -> dict:
    for field in ("rank", "local_rank", "node_rank"):
        env.source[field] = f"{field}=0 (single process)"
    return dict(rank=0, world_size=1, local_world_size=1, local_rank=0, node_rank=0)


_Detect = Callable[[Mapping[str, str]], bool]
_LAUNCHERS: list[tuple[str, _Detect, Callable[[_Reader], dict]]] = [
    ("agent", lambda e: names.RANK in e, _agent),
    ("torchrun", lambda e: "RANK" in e and "WORLD_SIZE" in e, _torchrun),
    ("slurm", lambda e: "SLURM_PROCID" in e, _slurm),
    # Open MPI 5 also sets PMIX_RANK, so PMIx alone means PALS only without OMPI_* variables.
    (
        "pals",
        lambda e: "PALS_RANKID" in e or ("PMIX_RANK" in e and "OMPI_COMM_WORLD_RANK" not in e),
        _pals,
    ),
    ("openmpi", lambda e: "OMPI_COMM_WORLD_RANK" in e, _openmpi),
]


def _finish(env: _Reader, launcher: str, f: dict) -> LaunchEnv:
    rank, world = f["rank"], f["world_size"]
    local_rank, local_world = f["local_rank"], f["local_world_size"]
    num_nodes = f.get("num_nodes") or -(-world // local_world)
    src = env.source
    if rank >= world:
        raise LaunchError(f"rank {src['rank']} is not below world size {src['world_size']}")
    if local_rank >= local_world:
        raise LaunchError(
            f"local rank {src['local_rank']} is not below local world size "
            f"{src['local_world_size']}"
        )
    if local_world > world:
        raise LaunchError(
            f"local world size {src['local_world_size']} exceeds world size {src['world_size']}"
        )
    if f["node_rank"] >= num_nodes:
        raise LaunchError(
            f"node rank {src['node_rank']} is not below the number of nodes ({num_nodes})"
        )
    job_id = f.get("job_id") or ""
    planned = launcher == "agent"  # the plan's address and port, whatever else is set
    addr = f.get("master_addr") if planned else env.text("MASTER_ADDR") or f.get("master_addr")
    if not addr:
        if num_nodes > 1:
            raise LaunchError(
                f"no rendezvous address for a {num_nodes}-node {launcher} launch: "
                "set MASTER_ADDR to the host of rank 0"
            )
        addr = LOCALHOST
    if env.text("MASTER_PORT") and not (planned and f.get("master_port")):
        port = env.integer("master_port", "MASTER_PORT", minimum=1)
    else:
        port = f.get("master_port") or derived_port(job_id)
    if port > 65535:
        raise LaunchError(f"{src['master_port']} is not a TCP port (1..65535)")
    return LaunchEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=f["node_rank"],
        num_nodes=num_nodes,
        job_id=job_id,
        restart_count=f.get("restart_count", 0),
        master_addr=addr,
        master_port=port,
        launcher=launcher,
        agent_store=f.get("agent_store", False),
    )
