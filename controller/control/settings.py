"""The controller's Settings from a job file: supervision's values, the node counts the job may
run on and the layout of each (supervision.when_no_spare, min_nodes), and what each plan
carries for the ranks (the launch)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from controller.control.view import Settings
from optimus.config import JobConfig
from optimus.planner.machines import default_machine, get_machine
from optimus.planner.replan import replan

# Node counts below --nodes for which the planner searches a layout (where the job's own does
# not run), nearest first: a search takes ~0.05 s for a small model and up to seconds for the
# largest, once, when the controller starts (2 s for jobs/gpt-175b.yaml's 192 nodes).
MAX_REPLANS = 16


def node_counts(job: JobConfig, nodes: int, ranks_per_node: int
                ) -> tuple[tuple[int, ...], dict[int, dict], dict[int, str]]:
    """Node counts the job may run on, largest first; the layout of each count below `nodes`
    (optimus/planner/replan.py: the job's own with a smaller dp, or the planner's best); and
    why each count it may not run on is refused. With `when_no_spare: wait`: `nodes` only."""
    s = job.supervision
    if s.when_no_spare == "wait" or s.on_replica_loss == "continue":  # replicas carry on
        # instead of shrinking; a job that restarts all the same waits for its nodes
        return (nodes,), {}, {}
    machine = get_machine(default_machine(job.parallel.device))
    lowest = min(s.min_nodes or -(-nodes // 2), nodes)
    counts, layouts, refused = [nodes], {}, {}
    searched = 0
    for n in range(nodes - 1, lowest - 1, -1):
        try:
            found = replan(job, n * ranks_per_node, ranks_per_node, machine,
                           search=searched < MAX_REPLANS)
        except Exception as e:  # noqa: BLE001 (a planner's bug must not stop the controller)
            found = f"the planner failed: {type(e).__name__}: {e}"[:300]
        searched += isinstance(found, str) or not found.own
        if isinstance(found, str):
            refused[n] = found
            continue
        counts.append(n)
        layouts[n] = found.as_dict()
    if counts != [nodes]:  # the full size's own layout, for the events' comparison
        with contextlib.suppress(Exception):  # without it the events say less, nothing else
            full = replan(job, nodes * ranks_per_node, ranks_per_node, machine)
            if not isinstance(full, str):
                layouts[nodes] = full.as_dict()
    return tuple(counts), layouts, refused


def settings_for(job: JobConfig, job_file: str, overrides: list[str], nodes: int,
                 ranks_per_node: int) -> Settings:
    s = job.supervision
    counts, layouts, refused = node_counts(job, nodes, ranks_per_node)
    faults = [{"node": f.node, "step": f.step, "generation": f.generation}
              for f in job.fault_injection.faults if f.kind == "kill_node"]
    return Settings(
        nodes=nodes, ranks_per_node=ranks_per_node,
        heartbeat_interval_s=s.heartbeat_interval_s, hang_timeout_s=s.hang_timeout_s,
        hang_floor_s=s.hang_floor_s, hang_history=s.hang_history,
        hang_step_factor=s.hang_step_factor, straggler_factor=s.straggler_factor,
        straggler_window=s.straggler_window, straggler_action=s.straggler_action,
        flaky_failures=s.flaky_failures, flaky_window_s=s.flaky_window_s,
        lost_limit=s.lost_limit, lost_window_s=s.lost_window_s,
        heartbeat_timeout_s=s.heartbeat_timeout_s, startup_timeout_s=s.startup_timeout_s,
        agent_timeout_s=s.heartbeat_timeout_s, max_restarts=s.max_restarts,
        backoff_s=s.restart_backoff_s, backoff_max_s=s.restart_backoff_max_s,
        failure_grace_s=s.failure_grace_s, stop_grace_s=s.stop_grace_s,
        final_step=job.optim.steps if job.checkpoint.interval else None,
        node_counts=counts, layouts=layouts, refusals=refused,
        start_short=s.min_nodes is not None,
        rewind_skip_before=job.stability.rewind_skip_before,
        rewind_skip_after=job.stability.rewind_skip_after,
        rewind_back=job.stability.rewind_back, rewind_budget=job.stability.rewind_budget,
        rewind_budget_steps=job.stability.rewind_budget_steps,
        batch_size=job.data.batch_size, replicas=job.parallel.replicas,
        on_replica_loss=s.on_replica_loss, min_replicas=s.min_replicas,
        launch={"job_file": str(Path(job_file).resolve()), "overrides": list(overrides),
                "log_dir": str(Path(job.resolved_run_dir).resolve() / "logs"),
                "node_faults": faults, "straggler_window": s.straggler_window,
                # a replica's ranks hold its quorum's groups and threads: a restart of the
                # whole job (below min_replicas) starts them as new processes (a relaunched
                # replica's survivors go on in process: controller/node/replica_worlds.py)
                "restart": "process" if s.on_replica_loss == "continue" else s.restart})
