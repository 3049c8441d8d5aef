"""What went wrong in a running generation, and whose fault it is: pure functions over a snapshot.

`decide._watch` calls `evidence(obs, s)` for everything that names a node, then
`hang_culprits(obs)` when nothing else explains a stall (past `stall_threshold`), and
`straggling(obs, s)`. Each piece of evidence says how
sure it is about its node:

- hard: the node itself is broken (a bad tile, a lost node, a node its peers cannot reach on
  the ranks' network: fabric.py). It is excluded at once.
- soft: a rank on the node failed (a crash, a frozen process, the culprit of a hang). The node
  is excluded once it has `flaky_failures` attributed failures within `flaky_window_s`
  (default 1: at once); before that the job restarts on it.
- collateral: a rank failed because a peer did (connection errors, NaN gradients that came
  from another rank). Never blamed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.control import fabric
from optimus.contract.exits import EXIT_BAD_TILE, EXIT_NONFINITE_ELSEWHERE, meaning
from optimus.contract.phases import COLLECTIVE_PHASES, LONG_PHASES, PEER_FAILURE

# The exit statuses, the phases (which are collective: where a rank waits with its peers) and
# the last words of a rank that failed because a peer did (PEER_FAILURE: its collective or the
# rendezvous store lost a partner; the rank's own test of whether it may go on in process) are
# the contract's, which the ranks use too (optimus/contract/).

HARD, SOFT, COLLATERAL = "hard", "soft", "collateral"
# Why a generation ended, for the restarts counter (bounded: these values only).
CAUSES = ("rank_exit", "heartbeat", "node_lost", "network", "hang", "bad_tile", "straggler",
          "operator", "rewind", "resize", "unattributed")


@dataclass(frozen=True)
class Evidence:
    node: str
    what: str
    kind: str  # HARD, SOFT or COLLATERAL
    time: float
    cause: str = "unattributed"  # one of CAUSES
    rank: int | None = None  # the global rank it names, when it names one
    tile: str = ""  # "<node>/<index>", when it names a tile
    computed: bool = True  # a bad tile: ranks ran on it since it last passed its check

    @property
    def wrong_arithmetic(self) -> bool:
        """Hard evidence that a tile computed wrong for this job: nothing computed since it
        last passed its health check is to be trusted, checkpoints included."""
        return self.cause == "bad_tile" and self.kind == HARD and self.computed

    def fields(self) -> dict:
        """The structured fields of a failure event (their values, in Redis, are strings)."""
        return {"node": self.node, "rank": "" if self.rank is None else self.rank,
                "tile": self.tile, "cause": self.cause, "evidence": self.kind}


def exit_evidence(e) -> Evidence:
    if e.code == EXIT_BAD_TILE:
        return Evidence(e.node, f"bad tile {e.node}/{e.local_rank} (rank {e.rank}): "
                        f"{meaning(EXIT_BAD_TILE)}", HARD, e.time, "bad_tile", e.rank,
                        f"{e.node}/{e.local_rank}")
    collateral = e.code == EXIT_NONFINITE_ELSEWHERE or (
        bool(e.tail) and PEER_FAILURE.search(e.tail) is not None)
    return Evidence(e.node, e.describe(), COLLATERAL if collateral else SOFT, e.time,
                    "rank_exit", e.rank)


def evidence(obs, s) -> list[Evidence]:
    """Everything in the snapshot that says a node of the running generation failed."""
    plan = obs.plan
    nodes = plan["nodes"]
    in_plan = set(nodes)
    found = [exit_evidence(e) for e in obs.exits if e.failed]
    found += [Evidence(n, f"bad tile {obs.unhealthy[n]}", HARD, obs.now, "bad_tile",
                       tile=obs.unhealthy[n].split(":", 1)[0],
                       computed=n not in obs.unhealthy_idle)
              for n in nodes if n in obs.unhealthy]
    for node in (n for n in nodes if n in obs.nonfinite):
        bad = [(lr, b) for lr, b in sorted(obs.suspects.get(node, {}).items())
               if not b.get("finite", True)]
        which = ", ".join(f"{node}/{lr} (rank {b['rank']}, step {b['step']})" for lr, b in bad)
        found.append(Evidence(node, f"bad tile {which or node}: {meaning(EXIT_BAD_TILE)}",
                              HARD, obs.now, "bad_tile",
                              bad[0][1].get("rank") if bad else None,
                              f"{node}/{bad[0][0]}" if bad else ""))

    # A node is lost when its agent is silent past agent_timeout_s, or sooner when its agent
    # has missed beats (a healthy agent beats every interval whatever its ranks do) and either
    # its host no longer takes a connection to it (probe.py: the agent is gone, or the host)
    # or one of its ranks is overdue: a dead node is then named in seconds, not half a minute.
    late = {o.node for o in obs.overdue}
    lost = set()
    for n in nodes:
        beat = obs.agent_beats.get(n)
        silent = obs.now - beat if beat else None
        gone = obs.unreachable.get(n) if silent is not None else None
        if silent is None or silent > s.agent_timeout_s or (
                (n in late or gone) and silent > s.agent_silence_s):
            lost.add(n)
            why = f" and {gone}" if gone and silent <= s.agent_timeout_s else ""
            found.append(Evidence(n, f"node {n} lost: its agent has been silent for "
                                  f"{f'{silent:.1f} s' if silent is not None else 'ever'}"
                                  + why, HARD, beat or 0.0, "node_lost"))
    # A lost node's ranks fall silent with it: their heartbeats say nothing more. A rank is
    # overdue only once its agent has beaten after the deadline and still relays the old
    # heartbeat: an agent tick that is merely late is not a frozen rank.
    found += [Evidence(o.node, f"rank {o.rank} on {o.node}: {o.detail}", SOFT, o.since,
                       "heartbeat", o.rank) for o in obs.overdue
              if o.node in in_plan and o.node not in lost and o.confirmed]
    # The ranks' network (fabric.py): the one node every failure to connect points at is
    # replaced as a lost one is; with none, a node that refused to launch on its mesh check
    # holds the generation up (collateral: it restarts after settle_s, nobody excluded).
    cut = fabric.cut(obs)
    if cut is not None and cut.node in in_plan:
        found.append(Evidence(cut.node, cut.what, HARD, obs.now, "network"))
    elif cut is not None and cut.node is None:
        found += [Evidence(n, cut.what, COLLATERAL, obs.now, "network")
                  for n in cut.refused if n in in_plan]
    return found


# A stall in a phase longer than a step (LONG_PHASES: a save, an evaluation) is judged by the
# fixed bound (hang_timeout_s), not by the step times.


def stall_threshold(job, s, long_phase: bool = False) -> float:
    """A hang: no rank has moved past its step for this long. Adaptive once the generation has
    timed `hang_history` steps: max(floor, k x the p99 step time), so that a 5 s step is judged
    hung after ~50 s, not 600. Before that (a generation's first steps, its compiles), and while
    a rank saves a checkpoint or evaluates (`long_phase`): max(T, k x p99), T = hang_timeout_s.
    The p99 is over the last 32 samples (job.step_times), every generation's: their largest
    but for one in a hundred."""
    times = sorted(job.step_times)
    p99 = times[max(0, math.ceil(0.99 * len(times)) - 1)] if times else 0.0
    timed = job.progress_moves - 2  # the first two moves are a resume and a first step
    if long_phase or timed < s.hang_history or not times:
        return max(s.hang_timeout_s, s.hang_step_factor * p99)
    return max(s.hang_floor_s, s.hang_step_factor * p99)


def in_long_phase(beats: dict[str, dict[int, dict]], generation: int) -> bool:
    """Whether one of these ranks' heartbeats (node -> local rank -> beat) of `generation`
    says it saves a checkpoint or evaluates."""
    return any(b.get("phase") in LONG_PHASES for node_beats in beats.values()
               for b in node_beats.values() if b.get("generation") == generation)


def hang_culprits(obs) -> list[tuple[str, int, dict]]:
    """(node, local rank, heartbeat) of the ranks that hold the others up: those behind in
    step; else, at the front step, those outside the collective phase while others wait in it.
    Empty when the heartbeats name nobody. Only the running generation's members' beats of
    this generation count: a lost node's last records are never a culprit."""
    gen, members = obs.plan["generation"], set(obs.plan["nodes"])
    ranks = [(node, lr, b) for node, beats in sorted(obs.suspects.items()) if node in members
             for lr, b in sorted(beats.items()) if b.get("generation") == gen]
    if not ranks:
        return []
    front = obs.progress if obs.progress is not None else max(b["step"] for *_, b in ranks)
    behind = [r for r in ranks if r[2]["step"] < front]
    if behind:
        return behind
    outside = [r for r in ranks if r[2]["phase"] not in COLLECTIVE_PHASES]
    waiting = obs.waiting_in_collective or len(ranks) - len(outside)
    return outside if outside and waiting else []


def describe_rank(node: str, local_rank: int, beat: dict, now: float) -> str:
    return (f"rank {beat.get('rank', '?')} on {node} (local {local_rank}): step "
            f"{beat.get('step')}, phase {beat.get('phase')} for "
            f"{now - beat.get('phase_since', now):.1f} s")


def straggling(obs, s) -> dict[str, str]:
    """Plan nodes whose slowest rank's median compute time per step, over the window, exceeds
    `straggler_factor` x the median of the other nodes'; node -> why."""
    in_plan = set(obs.plan["nodes"])
    scores = {n: v for n, v in (obs.compute or {}).items() if n in in_plan}
    ordered = sorted(scores.values())
    position = {}  # score -> an index of it in `ordered` (equal scores share a median)
    for i, v in enumerate(ordered):
        position.setdefault(v, i)
    slow = {}
    for node, score in scores.items():
        if len(ordered) < 2:
            continue
        median = _median_without(ordered, position[score])  # O(1): linear in all
        if median > 0 and score > s.straggler_factor * median:
            slow[node] = (f"node {node} is a straggler: compute {score * 1e3:.0f} ms per step "
                          f"(median over its last {s.straggler_window} sampled steps) against "
                          f"{median * 1e3:.0f} ms for the others, {score / median:.1f}x > "
                          f"{s.straggler_factor:g}x")
    return slow


def _median_without(ordered: list[float], i: int) -> float:
    """The median of sorted `ordered` without its element `i`."""
    m = len(ordered) - 1

    def at(j: int) -> float:  # the j-th element of the list without element i
        return ordered[j] if j < i else ordered[j + 1]
    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def flaky(failures: dict[str, list[float]], node: str, now: float, s) -> tuple[bool, list]:
    """Record a soft failure of `node`; whether it now has `flaky_failures` in the window."""
    recent = [t for t in failures.get(node, []) if now - t <= s.flaky_window_s] + [now]
    return len(recent) >= s.flaky_failures, recent
