"""What `optimus job status` and `optimus node list` show: reads of the store, no request.

Split from ops.py, whose commands print them (as a table, or `-o json`).
"""

from __future__ import annotations

import json
import time

from controller.store.store import Store
from optimus.files import human_bytes


def _loads(raw: str | None, default):
    try:
        return json.loads(raw) if raw else default
    except ValueError:
        return default


def status(store: Store, record: dict[str, str]) -> dict:
    plan = store.plan() or {}
    running = plan.get("action") == "run"
    step = store.summaries.furthest_step() if running else None
    metrics = None
    if running and plan.get("nodes"):
        beat = store.rank_beats(plan["nodes"][0]).get(0)
        if beat and beat.get("generation") == plan.get("generation"):
            metrics = beat.get("metrics")
    excluded = store.excluded()
    rewinds = _loads(record.get("rewinds"), [])
    return {
        "job": store.job, "state": record.get("state"), "reason": record.get("reason", ""),
        "desired": record.get("desired") or None, "generation": int(record.get("generation", -1)),
        "step": step, "loss": (metrics or {}).get("loss"),
        "tokens_per_s": (metrics or {}).get("tokens_per_s"),
        "val_loss": (metrics or {}).get("val_loss"), "val_step": (metrics or {}).get("val_step"),
        "peak_memory": peak_memory(store) if running else None,
        "restarts": int(record.get("restarts", 0)),
        "restart_causes": _loads(record.get("restart_causes"), {}),
        "nodes": plan.get("nodes", []) if running else [],
        "world_size": plan.get("world_size") if running else None,
        "excluded": sorted(n for n, e in excluded.items() if e.get("mode") != "drain"),
        "draining": sorted(n for n, e in excluded.items() if e.get("mode") == "drain"),
        "stragglers": _loads(record.get("stragglers"), []),
        "latest_checkpoint": int(record["latest_checkpoint"])
        if record.get("latest_checkpoint") else None,
        # The newest in-memory snapshot usable now (the controller reads it every few seconds).
        "memory_snapshot": int(record["memory_snapshot"])
        if running and record.get("memory_snapshot") else None,
        # What the ranks of generation `resumed_generation` loaded (rank 0's own report).
        "resumed_generation": int(record["resumed_gen"]) if record.get("resumed_gen") else None,
        "resumed_from": int(record["resumed_step"]) if record.get("resumed_step") else None,
        "last_failure": _loads(record.get("last_failure"), None),
        # Time lost to restarts (cause -> seconds), and the last one the job recovered from.
        "time_lost_s": _loads(record.get("lost_s"), {}),
        "last_recovery": _recovery(_loads(record.get("last_recovery"), None)),
        # The stability rules' counts and thresholds (rank 0's); the controller's rewinds.
        "stability": (metrics or {}).get("stability"),
        "rewinds": len(rewinds), "last_rewind": rewinds[-1] if rewinds else None,
        "skips": _loads(record.get("skips"), []),
        "leader": store.fence.leader(),
    }


def peak_memory(store: Store) -> dict | None:
    """The largest peak memory of any running rank (its last logged step), allocated and
    reserved, and the rank with the largest allocated (an operator's next question)."""
    peak = store.summaries.peak_memory()
    if peak is None:
        return None
    beats = store.rank_beats(peak["allocated_node"]).values()
    top = max(beats, key=lambda b: (b.get("memory") or {}).get("allocated_bytes", -1),
              default={})
    return {"allocated_bytes": peak["allocated_bytes"], "reserved_bytes": peak["reserved_bytes"],
            "rank": top.get("rank")}


def memory_text(peak: dict) -> str:
    rank = f" (rank {peak['rank']})" if peak.get("rank") is not None else ""
    return (f"{human_bytes(peak['allocated_bytes'])} allocated{rank}, "
            f"{human_bytes(peak['reserved_bytes'])} reserved")


def nodes(store: Store) -> list[dict]:
    info, beats, excluded = store.nodes(), store.agent_beats(), store.excluded()
    plan = store.plan() or {}
    running = plan.get("action") == "run"
    index = {n: i for i, n in enumerate(plan.get("nodes", []))} if running else {}
    names = sorted(set(info) | set(beats) | set(excluded))
    status = store.agent_status(names)
    steps = store.summaries.node_steps()
    rpn = plan.get("ranks_per_node", 0)
    now = time.time()
    rows = []
    for name in names:
        st, entry = status.get(name, {}), excluded.get(name)
        if entry is not None:
            role = "draining" if entry.get("mode") == "drain" else "excluded"
            note = f"{entry.get('reason', '')} (by {entry.get('by', '?')})"
        else:
            role, note = "spare", ""
        if name in index:
            first = index[name] * rpn
            role = (f"ranks {first}-{first + rpn - 1}" + (f", {role}" if entry else ""))
        age = now - beats[name] if name in beats else None
        agent = ("gone" if st.get("state") == "gone" else "never" if age is None
                 else f"{st.get('state', '?')}, {age:.1f} s ago")
        node_info = info.get(name, {})
        rows.append({"node": name, "host": node_info.get("host", st.get("host", "")),
                     "role": role, "agent": agent,
                     "health": node_info.get("health_detail") or node_info.get("health", "?"),
                     "live_ranks": int(st.get("live_ranks", 0)),
                     "step": int(steps[name]) if name in steps else None,
                     "excluded": entry, "note": note})
    return rows


def _recovery(last) -> dict | None:
    """The last recovery as `job status` shows it: the generation, the cause, the seconds lost
    and the step passed (the controller's record, less its time)."""
    if not isinstance(last, dict):
        return None
    return {k: last[k] for k in ("generation", "cause", "seconds", "step") if k in last}

