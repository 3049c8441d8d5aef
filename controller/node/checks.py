"""Whether this node may take a generation: its tiles' health check (on registering, before
every generation it takes part in, on demand) and whether it can run the job at all.
"""

from __future__ import annotations

from controller.node.health_check import health_check
from controller.store.store import StoreUnavailable


class Checks:
    """The agent's checks of its node (mixed into `Agent`: uses its store, events and ranks)."""

    def _check_health(self) -> dict:
        """The check (in a child of the warm process, or a fresh process: never in the agent,
        which imports no torch), and whether ranks ran here since the last one that passed: a
        tile found bad that computed nothing since then put nothing wrong into any checkpoint."""
        result = health_check(self.node, self.corrupt_tiles, self.spawner)
        ran = self.ran_since_ok or self._live()
        self.ran_since_ok = self._live() if result["health"] == "ok" else ran
        return {**result, "ran_since_ok": ran}

    def _healthy_for(self, generation: int) -> bool:
        """The deterministic check, before every generation this node takes part in."""
        self.info = {**self.info, **self._check_health()}
        try:
            self.store.set_health(self.node, self.info)
        except StoreUnavailable as e:
            self._note_outage(e)
        if self.info["health"] != "ok":
            self._event("health", f"{self.node} fails its health check before generation "
                        f"{generation}: bad tile {self.info['health_detail']}")
            return False
        return True

    def _can_run(self, plan: dict) -> bool:
        """Whether this node can run the job as the ranks will read it. A job asking for
        float8 where torchao is missing or the device has no float8 matmuls is the job's fault,
        not the node's (its nodes are all of one kind): no rank starts, and the agent says so
        in its own record, `refused` in `agent:<node>` (written with its next tick: a key its
        ACL user may write, where `requests` is the operators'), which the controller turns
        into a stop of the job, with the reason, instead of excluding the node."""
        problem = job_problem_here(plan["job_file"], plan.get("overrides", []))
        if problem is None:
            self.refusal = None
            return True
        self.refusal = {"generation": plan["generation"], "host": self.host, "reason": problem}
        self._event("refused", f"{self.node} refuses generation {plan['generation']}: "
                    f"{problem}")
        return False


def job_problem_here(job_file: str, overrides: list[str]) -> str | None:
    """Why this machine cannot run the job file (with its overrides) at all, or None.

    Reading the job is cheap (no torch); only a job that asks for float8 has the device
    asked, which imports torch into the agent once (seconds, within its heartbeat timeout)."""
    from optimus.config import ConfigError, load_job

    try:
        job = load_job(job_file, list(overrides))
    except ConfigError:
        return None  # each rank names that problem in its log, as it always has
    if job.training.float8 == "off":
        return None
    from optimus.parallel.float8 import check_float8_here

    try:
        check_float8_here(job, source=job_file)
    except ConfigError as e:
        return str(e)
    return None
