"""The records the controller and the agents exchange through Redis, typed and versioned: the
plan (controller -> agents: one generation of the whole world) and a rank's exit record (agent
-> controller). docs/redis-schema.md describes each field; a test holds the two to the same
names.

Each is built through its type where it is written (the controller's decide.py, the agent's
lifecycle.py) and checked where it is read back (controller/store/): whoever holds the
credentials can write these keys, so a value may be anything. A record with a missing or
mistyped field, or one this version does not know, is refused whole with one line naming the
field (`RecordError`), never a traceback.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

VERSION = 1  # of both records; a reader refuses any other
ACTIONS = ("run", "stop", "end")


class RecordError(ValueError):
    """A record that is not what its writer writes: `what` names the field, in one line."""

    def __init__(self, kind: str, what: str):
        self.kind, self.what = kind, what
        super().__init__(f"{kind}: {what}")


class _Strict(BaseModel):
    # strict: no coercion ("3" is no rank, true is no count); forbid: a field this version
    # does not know is refused too.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Record(_Strict):
    KIND: ClassVar[str] = "record"
    version: Literal[1] = VERSION

    @classmethod
    def parse(cls, value: object) -> Self:
        """`value` (a decoded JSON object) as this record, or a RecordError naming the field."""
        if not isinstance(value, dict):
            raise RecordError(cls.KIND, "it is no JSON object")
        if "version" not in value:
            raise RecordError(cls.KIND, "field 'version' is missing")
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            raise RecordError(cls.KIND, _first(e)) from None

    def record(self) -> dict[str, Any]:
        """The fields as written (those given, and the version), for JSON."""
        return {"version": self.version, **self.model_dump(exclude_unset=True)}


def _first(e: ValidationError) -> str:
    """The first problem pydantic found, as one line that names its field."""
    error = e.errors(include_url=False)[0]
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "missing":
        return f"field {where!r} is missing"
    if error["type"] == "extra_forbidden":
        return f"field {where!r} is not one of version {VERSION}'s"
    said = error["msg"].removeprefix("Value error, ").removeprefix("Input ")
    if not where:
        return said
    got = repr(error.get("input"))
    return f"field {where!r} {said} (got {got[:40] + '...' if len(got) > 40 else got})"


# --- a quorum of replicas --------------------------------------------------------------------

class Quorum(_Record):
    """The replicas that train together now (`supervision.on_replica_loss: continue`), as the
    controller names them: an id that only grows, the member replicas, and the store their
    cross-replica groups meet at (optimus/parallel/replicas.py). Given to each rank in its
    quorum file, replaced whole."""

    KIND: ClassVar[str] = "quorum"
    id: int = Field(ge=1)
    members: list[int] = Field(min_length=1)  # replica indices, ascending, no repeats
    store_addr: str = Field(min_length=1, max_length=255)
    store_port: int = Field(ge=1, lt=65_536)

    @model_validator(mode="after")
    def _ordered(self) -> Quorum:
        if any(m < 0 for m in self.members) or self.members != sorted(set(self.members)):
            raise ValueError("field 'members' must hold replica indices (>= 0), ascending, "
                             "each once")
        return self


# --- the plan --------------------------------------------------------------------------------

class Holder(_Strict):
    node: str  # the node that holds the shards
    addr: str  # its snapshot server, host:port ("" for none)


class Memory(_Strict):
    """The in-memory snapshot point a generation resumes from."""

    step: int
    generation: int
    holders: dict[str, Holder]  # replacement node -> the node it fetches its shards from


class NodeFault(_Strict):
    """A job file's kill_node fault: the node of rank `node` dies at `step` of `generation`."""

    node: int
    step: int
    generation: int


class Culprit(_Strict):
    node: str
    rank: int | None  # None: the node's fault, not one rank's


class ReplicaWorlds(_Strict):
    """Under `supervision.on_replica_loss: continue`: each data-parallel replica is a torch
    world of its own (nodes / replicas consecutive nodes of the plan), launched and relaunched
    on its own within one generation. Per replica, by index: where its rank 0 listens, how
    often it was launched in this generation (a count that grows: an agent relaunches its ranks
    when it does; a port of 0: its first node has not offered one yet, and the relaunch waits
    for it), and the newest quorum id its ranks of that launch must not join (their
    replica's place in older ones was the ranks they replace)."""

    addrs: list[str] = Field(min_length=2)
    ports: list[int] = Field(min_length=2)
    launches: list[int] = Field(min_length=2)
    after: list[int] = Field(min_length=2)

    @model_validator(mode="after")
    def _aligned(self) -> ReplicaWorlds:
        n = len(self.addrs)
        if not (len(self.ports) == len(self.launches) == len(self.after) == n):
            raise ValueError("fields 'addrs', 'ports', 'launches' and 'after' must hold one "
                             "entry per replica")
        if any(not 0 <= p < 65_536 for p in self.ports) or any(
                x < 0 for x in (*self.launches, *self.after)):
            raise ValueError("ports must be 0-65535 (0: not offered yet), launches and quorum "
                             "ids >= 0")
        return self


# What an agent needs to launch a generation: a "run" plan without one is refused.
RUN_FIELDS = ("ranks_per_node", "world_size", "master_addr", "master_port", "job_file",
              "log_dir")


class Plan(_Record):
    """The current generation, as the controller plans it (`plan` in Redis). A field with a
    default reads as it where the writer left it out (`record()` writes only those given)."""

    KIND: ClassVar[str] = "plan"
    generation: int
    action: Literal["run", "stop", "end"]
    nodes: list[str]  # in node-rank order
    ranks_per_node: int | None = Field(None, ge=1)
    world_size: int | None = Field(None, ge=0)
    master_addr: str | None = None
    master_port: int | None = Field(None, ge=0, lt=65_536)  # 0: node 0's agent picks one
    resume_step: int | None = None  # None: from scratch
    grace_s: float = 3.0  # before SIGKILL, once told to stop
    heartbeat_timeout_s: float = 30.0
    startup_timeout_s: float = 300.0
    job_file: str | None = None
    overrides: list[str] = []
    layout: str | None = None  # a shrunk generation's re-planned layout
    log_dir: str | None = None
    node_faults: list[NodeFault] = []
    straggler_window: int = Field(20, ge=1)
    restart: Literal["in_process", "process"] | None = None
    reason: str | None = None
    issued: float | None = None
    exits_from: str | None = None  # the `exits` id before this generation
    buddies: dict[str, Holder] = {}  # node -> who holds its snapshot copy
    peers: list[list[str]] | None = None  # the mesh check's ring: [node, snapshot address]
    memory: Memory | None = None
    skips: list[list[int]] | None = None  # every rewind's [first, last] skipped steps
    lineage: list[list[int]] | None = None  # [generation, resume step] pairs (-1: scratch)
    failed_saves: int | None = Field(None, ge=0)
    save: bool = True  # False: the ranks it stops save nothing
    culprit: Culprit | None = None  # whom a failure's stop names
    replicas: ReplicaWorlds | None = None  # replicas that carry on: each its own world
    quorum: Quorum | None = None  # ... and the replicas training together now

    @model_validator(mode="after")
    def _launchable(self) -> Plan:
        if self.action == "run":
            for name in RUN_FIELDS:
                if getattr(self, name) is None:
                    raise ValueError(f"field {name!r} is missing from a run plan")
        if self.replicas is not None:
            count = len(self.replicas.launches)
            if self.quorum is None or len(self.nodes) % count or any(
                    m >= count for m in self.quorum.members):
                raise ValueError("field 'replicas' needs a quorum of its replicas and a node "
                                 "count they divide")
        return self

    @property
    def replica_nodes(self) -> int:
        """The nodes of one replica (replicas: consecutive nodes); every node without them."""
        return len(self.nodes) // (len(self.replicas.launches) if self.replicas else 1)

    def replica_of(self, node_rank: int) -> int:
        """The replica the plan's node `node_rank` is part of."""
        return node_rank // self.replica_nodes


# --- a rank's exit ---------------------------------------------------------------------------

class ExitRecord(_Record):
    """A rank that ended (or left its generation to wait in process), as its agent saw it."""

    KIND: ClassVar[str] = "exit record"
    node: str
    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    generation: int = Field(ge=0)
    pid: int
    code: int | None  # its exit status; None when a signal ended it
    signal: int | None
    by_agent: bool  # the agent had told it to stop
    time: float
    tail: str  # the last lines of its own output
    tail_age: float | None  # seconds since it last wrote one (None: no log)
    in_process: bool = False  # it left its generation and waits for the next
    launch: int = Field(0, ge=0)  # its replica's launch in the generation (ReplicaWorlds)


