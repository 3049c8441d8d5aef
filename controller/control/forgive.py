"""A flap is not a death sentence: a node the controller excluded as lost goes back to the
spares once it is back and well.

A node is declared lost seconds after its agent falls silent (detect.evidence), and that stays
so: a dead host costs the job as little as it can. But a management network that flaps (a
switch restarting) silences healthy nodes as surely as a dead host does, and an exclusion that
lasted until an operator's `optimus node include` cost the job those nodes for good. So an
exclusion whose record says the controller made it for a lost node (`cause`: node_lost) is
lifted once the node is back: its agent beats again, none of its ranks runs (an agent kills
the ranks of a generation that went on without it), and it passed a health check taken after
the exclusion (its agent checks once its ranks are gone, and publishes the result:
controller/node/checks.py). It is then a spare like any other, with a `forgiven` event.

Unless it is lost too often. Each loss is counted in the job record (`losses`: node -> the
times it was excluded as lost, within the window), which a new leader reads as the old one
left it; a node lost `lost_limit` times within `lost_window_s` stays excluded until an operator
includes it, said once (a `not_forgiven` event) when that loss is counted. Operators'
exclusions and a health check's (a bad tile) are never lifted here: their records carry no
such cause. Called by `decide` every tick, in any state.
"""

from __future__ import annotations

from controller.control.view import Decision, NodeView, Observed, Settings

LOST = "node_lost"  # the cause of the exclusions this rule may lift (detect.CAUSES)


def forgive(obs: Observed, s: Settings, d: Decision) -> None:
    """Count each new loss; include the nodes excluded as lost that are back and well."""
    losses = {node: list(times) for node, times in obs.job.losses.items()}
    counted = False
    for node, v in sorted(obs.lost.items()):
        at = v.excluded_at
        if at is None or node not in obs.excluded:  # an operator included it this tick
            continue
        times = losses.setdefault(node, [])
        if at not in times:  # a loss not counted yet: counted now, once
            times.append(at)
            counted = True
            if _count(times, at, s) >= s.lost_limit:
                d.note("not_forgiven", f"node {node} stays excluded: lost "
                       f"{_count(times, at, s)} times within {s.lost_window_s:g} s "
                       f"(supervision.lost_limit={s.lost_limit}), more than a flap explains; "
                       f"`optimus node include {node}` brings it back once it is mended",
                       **_fields(node, times, at, s))
        if _count(times, at, s) >= s.lost_limit or not back(v):
            continue
        d.include.append(node)
        d.note("forgiven", f"node {node} back among the spares: excluded as lost "
               f"{obs.now - at:.1f} s ago, its agent beats again, none of its ranks runs and "
               f"it passed a health check {obs.now - v.checked_at:.1f} s ago; lost "
               f"{_count(times, at, s)} of {s.lost_limit} times within {s.lost_window_s:g} s",
               **_fields(node, times, at, s))
    if counted:
        d.job["losses"] = {node: kept for node, times in sorted(losses.items())
                           if (kept := _counting(node, times, obs, s))}


def back(v: NodeView) -> bool:
    """Whether a node excluded as lost is back and well: its agent beats (not late), none of
    its ranks runs, and its last passing health check is newer than the exclusion."""
    return (v.alive and not v.silent and v.healthy and v.live_ranks == 0
            and v.checked_at is not None and v.excluded_at is not None
            and v.checked_at > v.excluded_at)


def _count(times: list[float], at: float, s: Settings) -> int:
    """The losses within the window that ends with the one at `at`, that one included."""
    return sum(1 for t in times if at - t <= s.lost_window_s)  # none is newer than `at`


def _counting(node: str, times: list[float], obs: Observed, s: Settings) -> list[float]:
    """The losses worth keeping: within the window of now, or of the node's exclusion in
    force (a node kept out stays so however long it is away)."""
    v = obs.lost.get(node)
    ends = [obs.now] + ([v.excluded_at] if v is not None and v.excluded_at is not None else [])
    return [t for t in times if any(end - t <= s.lost_window_s for end in ends)]


def _fields(node: str, times: list[float], at: float, s: Settings) -> dict:
    return {"node": node, "losses": _count(times, at, s), "lost_limit": s.lost_limit,
            "lost_window_s": s.lost_window_s, "excluded_at": at}
