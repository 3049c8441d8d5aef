"""The `optimus` command, whole: the training core's commands plus the control plane's.

`optimus/cli.py` holds what runs inside a rank (train, config, data, checkpoint); this module
adds `run`, `controller`, `agent` and `chaos` to the same group, so `optimus/` never imports
`controller/`. The console script `optimus` points here; ranks run `python -m optimus`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import click

import optimus.cli as core
from controller.cli import (
    ops,  # noqa: F401 (adds `optimus job`, `optimus node`, `optimus events`)
    rewind,  # noqa: F401 (adds `optimus job rewind`)
)
from controller.control.journal import read_journal
from controller.node.folders import UnsafeFolder
from controller.schedulers import pbs, slurm
from controller.store.connect import Denied, NothingListens, fail_if_refused, has_secret
from controller.store.store import Store, StoreUnavailable, redis_url
from optimus.config import ConfigError, check_job, check_replica_nodes, load_job
from optimus.contract import chaos as kinds
from optimus.contract import env

core.USER_ERRORS = (*core.USER_ERRORS, StoreUnavailable, NothingListens, Denied, UnsafeFolder)
main = core.main


def _url_in_argv(ctx, param, value):
    """A click callback: a password on the command line is visible to every local user."""
    if value and has_secret(value):
        click.secho("warning: --redis carries a password, which every user of this machine "
                    "can read in the process list; put the URL in $REDIS_URL instead",
                    fg="yellow", err=True)
    return value


redis_option = click.option(
    "--redis", "redis", metavar="URL", default=None, callback=_url_in_argv,
    help="redis:// or rediss:// URL; default $REDIS_URL, else redis://127.0.0.1:6379/0. A URL "
         "with a password (user:password@ for ACLs) belongs in $REDIS_URL: a command line is "
         "visible to every user of the machine.")


def _operator_store(redis: str | None, job_name: str) -> Store:
    """The store for a one-shot command: one that fails at once where nothing listens."""
    url = redis_url(redis)
    fail_if_refused(url)
    return Store(url, job_name)


def _logging(verbose: bool = True) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def _terminate_on_sigterm() -> None:
    """SIGTERM ends the process through SystemExit, so `finally` blocks run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@main.command()
@core.job_argument
@core.set_option
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes the job runs on (each simulated by an agent).")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--spares", type=click.IntRange(min=0), default=0, show_default=True,
              help="Extra healthy nodes held back for restarts.")
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.5), default=5.0,
              show_default=True, help="Controller leader lease, seconds.")
def run(job: Path, overrides: tuple[str, ...], nodes: int, ranks_per_node: int, spares: int,
        lease_s: float) -> None:
    """Run JOB on this machine under the full control plane: Redis, a controller, agents."""
    from controller.cli.run import run_local

    config = load_job(job, list(overrides))
    check_job(config, world=nodes * ranks_per_node, source=str(job))
    check_replica_nodes(config, nodes, source=str(job))
    if config.training.float8_asked:  # torch and torchao: ~1.5 s of CPU, only when asked
        from optimus.parallel.float8 import check_float8_here

        check_float8_here(config, source=str(job))  # the nodes are this machine
    sys.exit(run_local(config, str(job), list(overrides), nodes=nodes,
                       ranks_per_node=ranks_per_node, spares=spares, lease_s=lease_s))


@main.command()
@core.job_argument
@core.set_option
@click.option("--nodes", type=click.IntRange(min=1), required=True)
@click.option("--ranks-per-node", type=click.IntRange(min=1), required=True)
@redis_option
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.5), default=5.0,
              show_default=True, help="Leader lease, seconds: a standby takes over within it.")
@click.option("--id", "ident", default=None, help="This controller's name in events.")
@click.option("--exit-when-done", is_flag=True, help="Exit once the job has ended.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus /metrics here; default monitoring.metrics_port; 0: off.")
@click.option("--linger", "linger_s", type=click.FloatRange(min=0), default=None,
              help="With --exit-when-done, serve /metrics this long after the job ended; "
                   "default monitoring.linger_s.")
@click.option("--resubmit", is_flag=True,
              help="If Redis holds the job as FAILED or STOPPED, start it again from its "
                   "latest committed checkpoint (exclusions stay); without this, an ended job "
                   "is left alone.")
@click.option("--allocation", metavar="TEXT", default=None,
              help="This controller starts in a new allocation (TEXT names it in the events, "
                   "e.g. the scheduler's job id): whatever Redis holds of an earlier one, a job "
                   "FAILED, STOPPED or left running when its allocation ended, becomes a new "
                   "submission, as with --resubmit. A COMPLETED job is left alone.")
@click.option("--standby", is_flag=True,
              help="Start as the hot standby: wait until another controller leads before "
                   "trying for the lease, so the leader's --resubmit/--allocation goes first.")
def controller(job: Path, overrides: tuple[str, ...], nodes: int, ranks_per_node: int,
               redis: str | None, lease_s: float, ident: str | None,
               exit_when_done: bool, metrics_port: int | None, linger_s: float | None,
               resubmit: bool, allocation: str | None, standby: bool) -> None:
    """Supervise JOB: plan generations, detect failures, restart without the culprit.

    Run two for high availability: one leads, the other takes over if it dies."""
    from controller.control.controller import Controller
    from controller.control.settings import settings_for

    _logging()
    config = load_job(job, list(overrides))
    check_job(config, world=nodes * ranks_per_node, source=str(job))
    check_replica_nodes(config, nodes, source=str(job))
    store = Store(redis_url(redis), config.name)
    store.ping()
    if standby:
        _wait_for_a_leader(store)
    elif resubmit or allocation:
        _resubmit(store, config, allocation)
    settings = settings_for(config, str(job), list(overrides), nodes, ranks_per_node)
    ctl = Controller(store, config, settings, ident=ident, lease_s=lease_s)
    from controller.exporter import serve

    url = serve(store, config, leading=lambda: ctl.leading, port=metrics_port,
                agent_timeout_s=settings.agent_timeout_s)
    if url:
        logging.getLogger("optimus.controller").info("Prometheus metrics at %s", url)
    _terminate_on_sigterm()
    try:
        state = ctl.run(exit_when_done=exit_when_done)
        click.echo(f"job {config.name}: {state}")
    finally:
        ctl.release()
    linger = config.monitoring.linger_s if linger_s is None else linger_s
    if url and linger:  # the final state, for one or two more scrapes
        time.sleep(linger)


def _resubmit(store: Store, config, allocation: str | None = None) -> None:
    """A job that FAILED or was STOPPED becomes a new submission: its checkpoints stay (the
    first generation resumes from the latest), and so do its exclusions. A COMPLETED job is
    left alone, so a controller restarted with --resubmit never trains a finished job again.

    In a new allocation (`allocation`, e.g. a Slurm requeue) no agent of the old one is left,
    so a job still RUNNING in Redis (or in the journal, if Redis lost it) is stale: its plan
    names nodes that are gone, which the controller would otherwise blame and exclude."""
    from controller.control.decide import COMPLETED, FAILED, STOPPED

    journal_path = Path(config.resolved_run_dir) / "controller.json"
    journal = read_journal(journal_path) if allocation else {}
    record = store.job_record() or journal.get("job") or {}
    state = record.get("state")
    if allocation:
        store.event("controller", "allocation", f"{allocation}; job {config.name} found "
                    f"{state or 'new'}")
    if state in (None, COMPLETED) or (not allocation and state not in (FAILED, STOPPED)):
        return
    excluded = store.excluded() or journal.get("excluded", {})
    # The journal first: a controller still leading the ended job (Helm's stay up) that finds
    # the record gone must find no journal either, or it keeps the job as it ended.
    journal_path.unlink(missing_ok=True)
    store.reset()
    for node, entry in excluded.items():
        store.exclude(node, **{"reason": "restored", "by": "?", **entry})
    how = f"in a new allocation ({allocation})" if allocation else "(--resubmit)"
    store.event("controller", "resubmitted", f"job {config.name} was {state}; submitted "
                f"again {how}, from its latest committed checkpoint"
                + (f"; still excluded: {', '.join(sorted(excluded))}" if excluded else ""))


def _wait_for_a_leader(store: Store, timeout_s: float = 60.0) -> None:
    """A standby that raced the leader could act on what the leader is about to reset. If
    no leader shows up (it died first, or found the job COMPLETED and left), try anyway."""
    deadline = time.monotonic() + timeout_s
    while store.fence.leader() is None and time.monotonic() < deadline:
        time.sleep(0.25)


@main.group()
def submit() -> None:
    """Write the batch script that runs a job under a scheduler; print it or submit it."""


submit.add_command(slurm.command)
submit.add_command(pbs.command)


@main.command()
@click.option("--job", "job_name", required=True, help="The job's name (`name` in its file).")
@click.option("--node", required=True, callback=ops.node_names,
              help="This node's name, unique in the job: a hostname (letters, digits, '-', "
                   "'_' and dots).")
@redis_option
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.05), default=1.0,
              show_default=True, help="Seconds between round trips to Redis.")
@click.option("--host", envvar=env.HOST, callback=ops.host_address,
              help="The address other hosts reach this node at (rank 0's rendezvous, the "
                   "snapshot link): a hostname or an IP address of the interface they share. "
                   "Default: this machine's hostname, which some sites resolve to loopback "
                   "(docs/deploy.md). Also OPTIMUS_HOST.")
@click.option("--interface", envvar=env.INTERFACE, callback=ops.interface_name,
              help="The network interface the ranks' collectives use (gloo, NCCL, oneCCL): "
                   "its address is advertised unless --host says another, and the ranks get "
                   "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, CCL_KVS_IFACE and FI_TCP_IFACE "
                   "naming it (unless already set). Also OPTIMUS_INTERFACE.")
def agent(job_name: str, node: str, redis: str | None, interval_s: float,
          host: str | None, interface: str | None) -> None:
    """Run the node agent: register, start and stop ranks, relay heartbeats."""
    from controller.common import reach
    from controller.node.agent import Agent
    from optimus.runtime.network import collective_env

    _logging()
    if interface is not None:
        try:
            address = reach.interface_address(interface)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--interface") from None
        host = host or address
        os.environ.update(collective_env(interface, {}, os.environ))  # its ranks inherit them
    # Retries last one interval: the agent must get back to reaping its ranks.
    store = Store(redis_url(redis), job_name, retry_s=interval_s)
    store.ping()
    a = Agent(store, node, interval_s=interval_s, host=host)

    def on_term(*_):
        a.stop_all_now()
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    sys.exit(a.run())


# What each fault an operator may send does, for the help and the confirmation (the
# contract's kinds: optimus/contract/chaos.py).
CHAOS = {kinds.word(k.name): k.what for k in kinds.KINDS if k.operator}


@main.command(help="Inject FAULT into a running job, through the agent of the node concerned."
              "\n\n\b\n" + "\n".join(f"{k:<12} {v}" for k, v in CHAOS.items()))
@click.argument("fault", type=click.Choice(list(CHAOS)))
@ops.job_option
@click.option("--rank", type=click.IntRange(min=0),
              help="For kill-rank, freeze-rank, hang-rank, stall-rank and nan-rank.")
@click.option("--node", callback=ops.node_names,
              help="For kill-node and bad-tile: the node's name.")
@click.option("--tile", type=click.IntRange(min=0), default=0, show_default=True,
              help="For bad-tile: the device index whose health checks go wrong.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="For stall-rank: how long the rank sleeps.")
@click.option("--at-step", "--step", "at_step", type=click.IntRange(min=1), default=None,
              help="For hang-rank, stall-rank and nan-rank: the step it fires in (default: "
              "the first step the rank starts after its agent relays it); for spike, required.")
@redis_option
@ops.reason_option()
@ops.yes_option
def chaos(fault: str, job_name: str, rank: int | None, node: str | None, tile: int,
          seconds: float | None, at_step: int | None, redis: str | None, reason: str,
          yes: bool) -> None:
    store = _operator_store(redis, job_name)
    plan = store.plan()
    user, host = ops.actor()
    sent = {"time": time.time(), "by": f"{user}@{host}", "reason": reason}
    if fault == "bad-tile":  # the node need not be running ranks: a spare's tile can go bad
        _known_node(store, job_name, node)
        ops.confirm(yes, f"Chaos on job {job_name}: bad-tile on {node} (tile {tile}): "
                    f"{CHAOS[fault]}?")
        store.push_command(node, {"kind": "bad_tile", "tile": tile, **sent})
        click.echo(f"bad-tile sent to the agent of {node} (tile {tile}); the next health "
                   "check fails")
        return
    if not plan or plan.get("action") != "run":
        raise ConfigError(f"job {job_name} has no running generation in Redis; fix: check "
                          "--job and --redis (optimus run prints both)")
    if fault == "spike":
        _spike(store, plan, job_name, at_step, sent, yes)
        return
    if fault == "kill-node":
        if node is None:
            raise ConfigError("kill-node needs --node NAME; fix: one of "
                              + ", ".join(plan["nodes"]))
        target = node
    else:
        if rank is None or rank >= plan["world_size"]:
            raise ConfigError(f"{fault} needs --rank between 0 and {plan['world_size'] - 1}")
        target = plan["nodes"][rank // plan["ranks_per_node"]]
    if fault == "stall-rank" and seconds is None:
        raise ConfigError("stall-rank needs --seconds S: how long the rank sleeps in its step")
    in_step = kinds.from_word(fault) in kinds.IN_STEP  # the rank fires them itself
    if at_step is not None and not in_step:
        raise ConfigError(f"--at-step is for hang-rank, stall-rank and nan-rank, not {fault}")
    now = store.summaries.furthest_step() if in_step else None
    if at_step is not None and now is not None and at_step <= now:
        raise ConfigError(f"step {at_step} is past: the job is at step {now}; fix: --at-step "
                          f"{now + 2} or later (or leave it out: the next step)")
    if target not in store.nodes():
        raise ConfigError(f"no node {target!r} in job {job_name}; fix: one of "
                          + ", ".join(sorted(store.nodes())))
    what = f"rank {rank} (on {target})" if rank is not None and fault != "kill-node" else target
    ops.confirm(yes, f"Chaos on job {job_name}: {fault} {what}: {CHAOS[fault]}?")
    command = {"kind": kinds.from_word(fault), "rank": rank, **sent}
    if fault == "stall-rank":
        command["seconds"] = seconds
    if at_step is not None:
        command["step"] = at_step
    store.push_command(target, command)
    when = ""
    if in_step:
        when = (f"; it fires in step {at_step}" if at_step is not None else
                "; it fires in the first step the rank starts once its agent relays it (the "
                "job is at step " + ("?" if now is None else str(now)) + "; the agent's next "
                "tick, then the rank's next step: the rank's log and a chaos event say which)")
    click.echo(f"{fault} sent to the agent of {target}"
               + (f" (rank {rank})" if rank is not None else "") + when)


def _spike(store: Store, plan: dict, job_name: str, at_step: int | None, sent: dict,
           yes: bool) -> None:
    """Every node's agent is told; each rank poisons its share of that step's batch, so all
    of them judge the same global loss. A rank already past the step when its agent relays it
    says so and poisons nothing (a step later would poison some ranks' shares only)."""
    now = store.summaries.furthest_step()
    if at_step is None:
        raise ConfigError("spike needs --at-step S: the step whose batch is poisoned (every rank "
                          f"must reach it after the command: the job is at step {now})")
    if now is not None and at_step <= now + 1:
        raise ConfigError(f"step {at_step} is too near: the job is at step {now}; fix: --at-step "
                          f"{now + 3} or later (every node's agent relays it first)")
    ops.confirm(yes, f"Chaos on job {job_name}: spike at step {at_step}: {CHAOS['spike']}?")
    for name in plan["nodes"]:
        store.push_command(name, {"kind": kinds.SPIKE, "step": at_step, **sent})
    click.echo(f"spike sent to the agents of {len(plan['nodes'])} node(s): every rank poisons "
               f"its share of step {at_step}'s batch (events: kind chaos, then stability)")


@main.command("health-check")
@click.option("--job", "job_name", required=True)
@click.option("--node", "nodes", multiple=True, callback=ops.node_names,
              help="A node to check (repeatable); default all.")
@redis_option
def health_check_command(job_name: str, nodes: tuple[str, ...], redis: str | None) -> None:
    """Run the deterministic tile check on nodes now; a node that fails is excluded."""
    store = _operator_store(redis, job_name)
    targets = list(nodes) or sorted(store.nodes())
    for node in targets:
        _known_node(store, job_name, node)
        store.push_command(node, {"kind": "health_check", "time": time.time()})
    click.echo(f"health check asked of {', '.join(targets) or 'no node'}; results in the "
               "events (kind health) and `nodes`")


def _known_node(store: Store, job_name: str, node: str | None) -> None:
    known = store.nodes()
    if node not in known:
        raise ConfigError(f"no node {node!r} in job {job_name}; fix: --node one of "
                          + (", ".join(sorted(known)) or "(none registered)"))

