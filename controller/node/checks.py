"""Whether this node may take a generation: its tiles' health check (on registering, before
every generation it takes part in, on demand), whether it can run the job at all, and whether
it reaches its peers on the ranks' network (the mesh check, mesh.py: before a launch, and
every couple of seconds while a generation runs).

The check before a generation is done ahead when it can be: once the node's ranks have left
their generation (or while it waits as a spare), the agent runs it between its ticks, and a
plan that comes while that check is fresh (passed at most FRESH_S ago, no rank run here since)
launches at once instead of after a check of its own (0.06-0.24 s of every restart on a
2-core VM; seconds where a tile's runtime starts slowly). A check that fails there is not
kept: the plan's own check runs, fails in its turn and is reported as before. What it proves
does not change either: a tile checked before its node's next ranks start, nothing computed on
it in between. On a spare (no rank ran there since its last pass) a check ahead that changes
the node's health is also said at once, as a check on demand is: the controller excludes a
spare gone bad before a plan counts on it. A check ahead that passes once a generation's ranks
have left is published too (quietly: the node's record, no event): a node the controller
excluded as lost, whose agent comes back from the outage and kills the ranks of a generation
that went on without it, is let back by that check, taken after its return
(controller/control/forgive.py). Where Redis does not take it, it is published again at the
next tick that can. That pass moves the record's `ok_at` but not its `window_from`, the pass a
bad tile's window opens at (controller/control/checkpoints.py): a check after the ranks left
proves nothing of what they computed, and the controller may be judging their work by that
window as it is published (a rank whose own loss went NaN exits: its agent checks at once),
until its next plan.
"""

from __future__ import annotations

import time

from controller.node.health_check import health_check
from controller.node.mesh import MeshCheck
from controller.node.spawn import Spawner
from controller.node.voice import Voice
from controller.store.store import Store, StoreUnavailable
from optimus.contract.records import Plan

FRESH_S = 30.0  # how long a passing check ahead of a plan stands for the plan's own
AGAIN_S = FRESH_S / 2  # an idle node's check is done again this often (spares stay fresh)


class Checks:
    """The checks of one node and what they found: the node's record (`info`: its facts and
    its last check's result), the check done ahead of a plan, whether the job can run here
    (`refusal`), the mesh check. The ranks' side asks before each launch (`healthy_for`,
    `can_run`, `meshed`) and says when ranks start (`ranks_started`)."""

    def __init__(self, store: Store, node: str, host: str, spawner: Spawner,
                 mesh: MeshCheck, voice: Voice, facts: dict):
        self.store, self.node, self.host = store, node, host
        self.spawner, self.mesh, self.voice = spawner, mesh, voice
        self.info = dict(facts)  # the node's record as the agent knows it
        self.corrupt_tiles: set[int] = set()  # fault injection: tiles whose checks go wrong
        self.ran_since_ok = False  # ranks ran here since the last passing health check
        self.refusal: dict | None = None  # the generation this node cannot run, and why
        self.ahead: dict | None = None  # a passing check done while no rank ran here, and when
        self.ahead_tried = float("-inf")  # monotonic time of the last check ahead, passed or not
        self.ahead_after: int | None = None  # the generation whose end the last one followed
        self.unpublished = False  # `info` holds a result Redis has not taken yet

    def first(self) -> None:
        """The check on registering: its result goes into the node's record."""
        self.info = {**self.info, **self.check_health()}

    def ranks_started(self) -> None:
        self.ran_since_ok = True

    def spoil(self, tile: int) -> None:
        """Fault injection: `tile` computes wrong from now on; a check done before no longer
        stands for the next plan."""
        self.corrupt_tiles.add(tile)
        self.ahead = None

    def check_ahead(self, generation: int | None, *, live: bool, job_ended: bool,
                    plan: Plan | None) -> None:
        """Between generations (no rank of this node runs: `live`; no `plan` for it waits;
        `job_ended` false), the check the next plan would run, done now: once the ranks of
        `generation` have left, and every AGAIN_S while idle where a check is a fork of the
        warm process, not a fresh interpreter (a failed one too: the plan's own check reports
        it)."""
        if self.unpublished:
            self.publish()
        if job_ended or live or plan_waits(plan, self.node, generation):
            return
        now = time.monotonic()
        ended = self.ran_since_ok and self.ahead_after != generation
        stale = (now - self.ahead_tried >= AGAIN_S and self.spawner.checks_cheaply
                 and (self.ahead is None or now - self.ahead["at"] >= AGAIN_S))
        if (ended or stale) and not self.spawner.warming():  # (asked only when one is due)
            self.ahead_after, self.ahead_tried = generation, now
            result = self.check_health()
            # A spare (no rank ran here since its last pass) whose health changed says so at
            # once, as a check on demand does: the controller excludes a spare gone bad before
            # a plan counts on it (its launch would fail the plan's check: a restart more) and
            # sees it pass again after a repair. Where ranks ran, the plan's own check reports
            # (and the controller sets their work aside).
            if not result["ran_since_ok"] and result["health"] != self.info.get("health"):
                self.say_health(result, "while idle")
            elif ended and result["health"] == "ok":  # the ranks left: a pass since they did
                # Its time is `ok_at` (forgive.py's proof of a check after a return), not where
                # a bad tile's window opens (`window_from`): it vouches for nothing the ranks
                # that just left computed, and the controller may be judging their work now.
                self.info = {**self.info, **result,
                             "window_from": self.info.get("window_from",
                                                          self.info.get("ok_at"))}
                self.publish()

    def publish(self) -> None:
        """The node's record as the agent knows it (its last check's result in it); kept for
        the next check ahead's turn if Redis does not take it now."""
        try:
            self.store.own.set_health(self.node, self.info)
            self.unpublished = False
        except StoreUnavailable as e:
            self.unpublished = True
            self.voice.outage(e)

    def say_health(self, result: dict, how: str) -> None:
        """Publish a check's result as the node's health and say it (`health check <how>`)."""
        self.info = {**self.info, **result}
        self.publish()
        self.voice.event("health", f"health check {how}: {self.node} " + (
            "ok" if result["health"] == "ok" else f"bad tile {result['health_detail']}"))

    def check_health(self, live: bool = False) -> dict:
        """The check (in a child of the warm process, or a fresh process: never in the agent,
        which imports no torch), and whether ranks ran here since the last one that passed (or
        run now: `live`): a tile found bad that computed nothing since then put nothing wrong
        into any checkpoint."""
        result = health_check(self.node, self.corrupt_tiles, self.spawner)
        ran = self.ran_since_ok or live
        self.ran_since_ok = live if result["health"] == "ok" else ran
        checked = {**result, "ran_since_ok": ran}
        if result["health"] == "ok":  # where a window would open (but see `check_ahead`)
            checked["window_from"] = result["ok_at"]
        self.ahead = ({"at": time.monotonic(), "result": checked}
                      if result["health"] == "ok" and not live else None)
        return checked

    def healthy_for(self, generation: int) -> bool:
        """The deterministic check, before every generation this node takes part in: the one
        done ahead if it still stands (`check_ahead`), else one now."""
        ahead = self.ahead
        fresh = (ahead is not None and time.monotonic() - ahead["at"] <= FRESH_S
                 and not self.ran_since_ok)
        self.info = {**self.info, **(ahead["result"] if fresh else self.check_health())}
        self.ahead = None  # this plan's: its ranks start now
        self.publish()
        if self.info["health"] != "ok":
            self.voice.event("health", f"{self.node} fails its health check before generation "
                             f"{generation}: bad tile {self.info['health_detail']}")
            return False
        return True

    def can_run(self, plan: Plan) -> bool:
        """Whether this node can run the job as the ranks will read it. A job asking for
        float8 where torchao is missing or the device has no float8 matmuls is the job's fault,
        not the node's (its nodes are all of one kind): no rank starts, and the agent says so
        in its own record, `refused` in `agent:<node>` (written with its next tick: a key its
        ACL user may write, where `requests` is the operators'), which the controller turns
        into a stop of the job, with the reason, instead of excluding the node."""
        problem = job_problem_here(plan.job_file, plan.overrides)
        if problem is None:
            self.refusal = None
            return True
        self.refusal = {"generation": plan.generation, "host": self.host, "reason": problem}
        self.voice.event("refused", f"{self.node} refuses generation {plan.generation}: "
                         f"{problem}")
        return False

    # --- the mesh check (mesh.py) -------------------------------------------------------------

    def meshed(self, plan: Plan) -> bool:
        """The mesh check before a launch, after the health check: whether the plan's ranks
        may start now. Not while its probes run (they wake the agent when they end); never when
        a node of the plan is out of reach on the ranks' network: the generation is refused,
        in `refused` with cause "network", which the controller does not take for a stop of
        the job (observe.py): it finds whose fault it is from every agent's report (fabric.py),
        excludes that node and plans again."""
        verdict = self.mesh.before_launch(plan)
        if verdict is not False:
            return bool(verdict)
        gen = plan.generation
        if (self.refusal or {}).get("generation") != gen:
            problem = (f"cannot reach {self.mesh.where(self.mesh.blocked)} on the ranks' "
                       "network (no answer from its snapshot server, twice in a row)")
            self.refusal = {"generation": gen, "host": self.host, "reason": problem,
                            "cause": "network"}
            self.voice.event("mesh", f"{self.node} refuses generation {gen}: {problem}",
                             generation=gen, refused=True, peers=",".join(self.mesh.blocked))
        return False

    def check_mesh(self, plan: Plan | None) -> None:
        """Each tick: the ring's neighbours, while a run plan stands (mesh.py); a neighbour
        that goes out of reach, or answers again, is said in a `mesh` event."""
        self.mesh.poll(plan)
        lost, back = self.mesh.news()
        if lost:
            self.voice.event("mesh", f"{self.node} cannot reach {self.mesh.where(lost)} on the "
                             "ranks' network (mesh check: no answer from its snapshot server, "
                             "twice in a row)", peers=",".join(lost), ok=False)
        if back:
            self.voice.event("mesh", f"{self.node} reaches {self.mesh.where(back)} again on the "
                             "ranks' network (mesh check)", peers=",".join(back), ok=True)


def plan_waits(plan: Plan | None, node: str, generation: int | None) -> bool:
    """Whether `plan` names `node` for a generation it has not launched yet (`generation`)."""
    return (plan is not None and plan.action == "run" and node in plan.nodes
            and plan.generation != generation)


def job_problem_here(job_file: str, overrides: list[str]) -> str | None:
    """Why this machine cannot run the job file (with its overrides) at all, or None.

    Reading the job is cheap (no torch); only a job that asks for float8 has the device
    asked, which imports torch into the agent once (seconds, within its heartbeat timeout)."""
    from optimus.config import ConfigError, load_job

    try:
        job = load_job(job_file, list(overrides))
    except ConfigError:
        return None  # each rank names that problem in its log, as it always has
    if not job.training.float8_asked:
        return None
    from optimus.parallel.float8 import check_float8_here

    try:
        check_float8_here(job, source=job_file)
    except ConfigError as e:
        return str(e)
    return None
