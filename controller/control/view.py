"""What the controller sees and decides, as plain values: the job states, its settings, one
snapshot of observations (`Observed`) and one `Decision`. Shared by the pure rules
(`decide.py`, `operator.py`, beside it in `controller/control/`) and the code that observes and
applies them (`controller.py`); nothing here touches Redis, a clock or a process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controller.common.exit_text import describe_exit

RUNNING, RESTARTING, PENDING, WAITING, STOPPING = (
    "RUNNING", "RESTARTING", "PENDING", "WAITING", "STOPPING")
PAUSING, PAUSED = "PAUSING", "PAUSED"
COMPLETED, FAILED, STOPPED = "COMPLETED", "FAILED", "STOPPED"
TERMINAL = (COMPLETED, FAILED, STOPPED)
ACTIVE = (RUNNING, PAUSING, PAUSED)  # a generation runs (its ranks train, or wait paused)
STATES = (PENDING, RUNNING, PAUSING, PAUSED, RESTARTING, WAITING, STOPPING, *TERMINAL)


@dataclass(frozen=True)
class Settings:
    nodes: int
    ranks_per_node: int
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    startup_timeout_s: float = 300.0
    agent_timeout_s: float = 30.0
    max_restarts: int = 10
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    failure_grace_s: float = 3.0  # SIGTERM -> SIGKILL when a generation failed
    stop_grace_s: float = 60.0  # ... when an operator stops the job (a checkpoint is saved)
    hang_timeout_s: float = 600.0  # the bound with no history, and of saves and evaluations
    hang_floor_s: float = 30.0  # the least bound once adaptive (detect.stall_threshold)
    hang_step_factor: float = 10.0
    hang_history: int = 8  # timed steps of a generation before its bound adapts
    straggler_factor: float = 2.0
    straggler_window: int = 20
    straggler_action: str = "report"
    flaky_failures: int = 1
    flaky_window_s: float = 3600.0
    # A node excluded as lost goes back to the spares once it is back and well, unless it was
    # lost this many times within the window (controller/control/forgive.py).
    lost_limit: int = 3
    lost_window_s: float = 3600.0
    # For the agents' stacks of a hang, before deciding anyway (they are usually in within a
    # second; a rank that does not answer SIGUSR1 costs its agent up to ~6 s:
    # controller/node/stacks.py)
    stack_wait_s: float = 8.0
    # With checkpointing on, the step whose commit COMPLETED requires (optim.steps); else None.
    final_step: int | None = None
    # Node counts a generation may run on, largest first: (nodes,) unless the job may shrink
    # when too few nodes are left (supervision.when_no_spare, min_nodes); the layout of each
    # count (optimus/planner/replan.py Replanned.as_dict: the `--set` assignments of a layout
    # other than the job file's, its label, predicted tokens/s; and the full size's), and why
    # a count between min_nodes and nodes is refused.
    node_counts: tuple[int, ...] = ()
    layouts: dict = field(default_factory=dict)
    refusals: dict = field(default_factory=dict)
    # Whether a first generation may start short (after agent_timeout_s): only when the job
    # names supervision.min_nodes; the default floor is for nodes lost on the way.
    start_short: bool = True
    launch: dict = field(default_factory=dict)  # job file, overrides, log dir: into each plan
    # Rewinds (stability.rewind_*; controller/control/rewind.py), and the global batch (an
    # operator's --skip-samples counts whole steps of it).
    rewind_skip_before: int = 0
    rewind_skip_after: int = 0
    rewind_back: int = 0
    rewind_budget: int = 3
    rewind_budget_steps: int = 1000
    batch_size: int = 1
    # Replicas that carry on (supervision.on_replica_loss: continue; replica_loss.py): the
    # data-parallel replicas, each launched as a world of its own, and the fewest that train on.
    replicas: int = 1
    on_replica_loss: str = "restart"
    min_replicas: int = 1

    @property
    def carry_on(self) -> bool:
        """Whether a lost replica leaves the quorum instead of restarting the job."""
        return self.on_replica_loss == "continue" and self.replicas >= 2

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def allowed_nodes(self) -> tuple[int, ...]:
        return self.node_counts or (self.nodes,)

    @property
    def agent_silence_s(self) -> float:
        """An agent this late (several missed beats) is suspect."""
        return 2 * self.heartbeat_interval_s

    @property
    def settle_s(self) -> float:
        """How long collateral-only evidence waits for a culprit to show."""
        return self.agent_timeout_s + 1.0

    def backoff(self, restarts: int) -> float:
        return min(self.backoff_s * 2 ** max(restarts - 1, 0), self.backoff_max_s)


@dataclass(frozen=True)
class JobView:
    state: str = PENDING
    reason: str = ""
    generation: int = -1  # the latest planned generation; -1: none yet
    restarts: int = 0
    desired: str | None = None  # "stop" or "pause" when an operator asked
    desired_by: str = ""
    desired_reason: str = ""
    requests_seen: str = "0"  # the id of the last operator request taken
    restart_causes: dict = field(default_factory=dict)  # cause -> restarts it caused
    failure_since: float | None = None
    next_plan_at: float | None = None
    # Progress of the running generation: the furthest step, when it was reached, and the
    # time per step of recent advances (for the hang threshold).
    progress_gen: int | None = None
    progress_step: int = -1
    progress_at: float | None = None
    progress_moves: int = 0
    step_times: tuple[float, ...] = ()
    hang_since: float | None = None  # a hang was noticed and stacks asked for
    failures: dict = field(default_factory=dict)  # node -> times of its soft failures
    losses: dict = field(default_factory=dict)  # node -> times it was excluded as lost
    stragglers: tuple[str, ...] = ()  # nodes reported as stragglers now
    # What the ranks of generation `resumed_gen` reported loading (None: from scratch).
    resumed_gen: int | None = None
    resumed_step: int | None = None
    # Evidence of wrong arithmetic: {"nodes", "generation", "evidence", "resumed_step",
    # "set_aside"}; the checkpoints it makes suspect are set aside once no rank of that
    # generation runs ("set_aside": true), and the window holds until the next plan.
    suspect: dict | None = None
    # Rewinds (controller/control/rewind.py): each [first, last] window of steps whose batches
    # are skipped, in order; and each rewind ({"step", "first", "last", "resume_step", "to",
    # "by", "reason", "time"}), the newest KEPT.
    skips: tuple = ()
    rewinds: tuple = ()
    # Time lost to restarts (watching.track_progress): where the job was when a restart was
    # decided ({"generation", "step", "at", "cause"}: actions.restarted), until a later
    # generation passes that step; then the seconds lost, per cause, and the last recovery
    # ({"generation", "cause", "seconds", "step", "time"}).
    behind: dict | None = None
    lost_s: dict = field(default_factory=dict)
    last_recovery: dict | None = None


@dataclass(frozen=True)
class NodeView:
    name: str
    host: str
    alive: bool  # its agent beat within agent_timeout_s
    healthy: bool
    health: str = "ok"
    excluded: str | None = None  # the reason, when excluded
    generation: int | None = None  # the generation its agent runs or last ran
    live_ranks: int = 0
    last_beat: float = 0.0
    silent: bool = False  # alive, but its agent missed beats (agent_silence_s): a suspect
    snapshot_addr: str = ""  # host:port of its agent's snapshot server
    next_port: int = 0  # the rendezvous port its agent holds for a plan making it node 0
    failed_saves: int | None = None  # saves failed in a row, as its ranks last said
    excluded_at: float | None = None  # when it was excluded (read for nodes excluded as lost)
    checked_at: float | None = None  # when it last passed its health check (its agent's ok_at)
    # Replicas that carry on: the launch of its replica its ranks are of (None: not in that
    # mode), and how many of them wait to be let into a quorum (phase standby).
    launch: int | None = None
    standby: int = 0


@dataclass(frozen=True)
class Exit:
    node: str
    rank: int
    generation: int
    code: int | None  # None when a signal ended it
    signal: int | None = None
    by_agent: bool = False  # the agent terminated it (a stop), not a fault
    tail: str = ""
    tail_age: float | None = None  # seconds between the log's last write and the exit
    time: float = 0.0
    local_rank: int = -1
    launch: int = 0  # its replica's launch (replicas that carry on)

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.by_agent

    @property
    def failed(self) -> bool:
        return not self.by_agent and (self.code != 0 or self.signal is not None)

    def describe(self) -> str:
        return describe_exit(self.rank, self.node, self.code, self.signal, self.tail,
                             self.tail_age)


@dataclass(frozen=True)
class Overdue:
    node: str
    rank: int
    detail: str  # e.g. "no heartbeat for 4.1 s (step 12, phase backward)"
    since: float = 0.0
    confirmed: bool = True  # the node's agent beat after the deadline, relaying the old beat


@dataclass(frozen=True)
class Observed:
    now: float
    job: JobView
    plan: dict | None
    nodes: dict[str, NodeView]
    exits: list[Exit] = field(default_factory=list)  # of the plan's generation
    overdue: list[Overdue] = field(default_factory=list)
    # The newest committed checkpoint; between generations, the one the next would load: not
    # suspect, and its files of the sizes its manifest lists (the sha256 is rank 0's to check).
    latest_step: int | None = None
    skipped: tuple[str, ...] = ()  # newer committed ones that fail that size check, and why
    suspect_steps: dict[int, str] | None = None  # job.suspect's checkpoints: step -> why
    resumed: dict | None = None  # rank 0's report: {"step", "quarantined": [{step, reason}]}
    # The running generation's sweep (see Summaries.sweep):
    agent_beats: dict[str, float | None] = field(default_factory=dict)  # plan node -> beat
    # Plan nodes whose agents are silent and whose hosts failed twice to take a connection to
    # them (controller/common/probe.py): node -> why.
    unreachable: dict[str, str] = field(default_factory=dict)
    # The ranks' network (controller/control/fabric.py): address -> the node whose record holds
    # it; the ring's agents' mesh reports of this generation (node -> the neighbours it cannot
    # reach), and the plan's nodes that refused to launch it on that check.
    addresses: dict[str, str] = field(default_factory=dict)
    mesh: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mesh_refused: frozenset[str] = frozenset()
    progress: int | None = None  # the furthest step any rank is at
    unhealthy: dict[str, str] = field(default_factory=dict)  # node -> "<node>/<tile>: why"
    unhealthy_idle: frozenset[str] = frozenset()  # of those, where no rank ran since a pass
    nonfinite: frozenset[str] = frozenset()  # nodes with a rank reporting NaN/Inf of its own
    suspects: dict[str, dict[int, dict]] = field(default_factory=dict)  # node -> heartbeats
    waiting_in_collective: int = 0  # plan nodes whose ranks all wait in a collective
    stacks: dict[int, str] = field(default_factory=dict)  # rank -> stack dump (a hang)
    compute: dict[str, float] | None = None  # node -> compute score, when read this tick
    # When compute is read: how many nodes outside the plan could replace one of it (registered,
    # healthy, beating, not excluded), as the controller last read them; None: not read.
    spare_count: int | None = None
    # A stalled generation's ranks read (the hang's candidates, or a sample of them) save a
    # checkpoint or evaluate: the stall is judged by the fixed bound (the contract's LONG_PHASES).
    long_phase: bool = False
    excluded: dict[str, str] = field(default_factory=dict)  # node -> reason (draining too)
    draining: frozenset[str] = frozenset()  # excluded from future generations only
    requests: list[Request] = field(default_factory=list)  # new operator requests, in order
    control: dict = field(default_factory=dict)  # what agents pass to ranks: pause, checkpoint
    paused_nodes: int = 0  # nodes of the running generation whose ranks all wait paused
    known_nodes: frozenset[str] = frozenset()  # every registered node (read with requests)
    # Between generations: each node's report of the in-memory snapshots it holds (and the
    # reports of nodes' earlier incarnations, `<node>@<incarnation>`).
    snapshots: dict[str, dict] = field(default_factory=dict)
    # A bad tile's window as memory points are judged by it (recovery.memory_point): {"nodes",
    # "since": when they last passed a health check, or None; "after_step"}.
    distrust: dict | None = None
    # While a generation runs, when the registered agents changed: the plan's nodes and the
    # spares (alive, healthy, not excluded, outside the plan) -> their snapshot server's
    # address; None: not read.
    spares: dict[str, str] | None = None
    # An operator's rewind taken from the requests this tick (operator.take_requests):
    # {"step", "window", "floor", "by", "reason", "said"}.
    rewind_asked: dict | None = None
    # Nodes the controller excluded as lost (their exclusion's cause: node_lost), as their
    # agents show them now, with `excluded_at` and `checked_at` (controller/control/forgive.py).
    lost: dict[str, NodeView] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    """An operator's request from the CLI (the `requests` stream), applied by the controller."""

    id: str
    action: str  # pause, resume, stop, checkpoint, exclude, drain, include
    actor: str
    host: str
    reason: str = ""
    time: float = 0.0
    node: str = ""
    checkpoint: bool = False  # pause: save a checkpoint first
    to: int | None = None  # rewind: the newest step to resume from
    skip: tuple[int, int] | None = None  # rewind: the steps whose batches are skipped
    samples: int | None = None  # rewind: ... or the samples after `to` that are

    @property
    def who(self) -> str:
        return f"{self.actor}@{self.host}" if self.host else self.actor


@dataclass
class Decision:
    job: dict[str, Any] = field(default_factory=dict)  # fields to write; None deletes
    plan: dict | None = None  # the new plan, when it changes
    exclude: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    causes: dict[str, str] = field(default_factory=dict)  # node excluded -> detect.CAUSES
    events: list[tuple[str, str, dict]] = field(default_factory=list)  # (kind, message, more)
    commands: list[tuple[str, dict]] = field(default_factory=list)  # (node, agent command)
    control: dict | None = None  # the new control word for the ranks, when it changes
    operator_exclude: list[tuple[str, dict]] = field(default_factory=list)  # (node, record)
    include: list[str] = field(default_factory=list)
    set_aside: list[tuple[int, str]] = field(default_factory=list)  # (step, why): quarantine

    def note(self, kind: str, message: str, **fields: Any) -> None:
        self.events.append((kind, message, fields))
