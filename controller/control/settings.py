"""The controller's Settings from a job file: supervision's values, the node counts the job may
run on (supervision.min_nodes), and what each plan carries for the ranks (the launch)."""

from __future__ import annotations

from pathlib import Path

from controller.control.view import Settings
from optimus.config import ConfigError, JobConfig, check_job


def node_counts(job: JobConfig, nodes: int, ranks_per_node: int) -> tuple[int, ...]:
    """Node counts the job may run on, largest first: from `nodes` down to
    supervision.min_nodes, those whose world size the layout accepts (dp shrinks)."""
    lowest = min(job.supervision.min_nodes or nodes, nodes)
    counts = []
    for n in range(nodes, lowest - 1, -1):
        try:
            check_job(job, world=n * ranks_per_node)
        except ConfigError:
            continue
        counts.append(n)
    return tuple(counts) or (nodes,)


def settings_for(job: JobConfig, job_file: str, overrides: list[str], nodes: int,
                 ranks_per_node: int) -> Settings:
    s = job.supervision
    faults = [{"node": f.node, "step": f.step, "generation": f.generation}
              for f in job.fault_injection.faults if f.kind == "kill_node"]
    return Settings(
        nodes=nodes, ranks_per_node=ranks_per_node,
        heartbeat_interval_s=s.heartbeat_interval_s, hang_timeout_s=s.hang_timeout_s,
        hang_floor_s=s.hang_floor_s, hang_history=s.hang_history,
        hang_step_factor=s.hang_step_factor, straggler_factor=s.straggler_factor,
        straggler_window=s.straggler_window, straggler_action=s.straggler_action,
        flaky_failures=s.flaky_failures, flaky_window_s=s.flaky_window_s,
        heartbeat_timeout_s=s.heartbeat_timeout_s, startup_timeout_s=s.startup_timeout_s,
        agent_timeout_s=s.heartbeat_timeout_s, max_restarts=s.max_restarts,
        backoff_s=s.restart_backoff_s, backoff_max_s=s.restart_backoff_max_s,
        failure_grace_s=s.failure_grace_s, stop_grace_s=s.stop_grace_s,
        final_step=job.optim.steps if job.checkpoint.interval else None,
        node_counts=node_counts(job, nodes, ranks_per_node),
        rewind_skip_before=job.stability.rewind_skip_before,
        rewind_skip_after=job.stability.rewind_skip_after,
        rewind_back=job.stability.rewind_back, rewind_budget=job.stability.rewind_budget,
        rewind_budget_steps=job.stability.rewind_budget_steps,
        batch_size=job.data.batch_size,
        launch={"job_file": str(Path(job_file).resolve()), "overrides": list(overrides),
                "log_dir": str(Path(job.resolved_run_dir).resolve() / "logs"),
                "node_faults": faults, "straggler_window": s.straggler_window,
                "restart": s.restart})
