"""The operator's commands: `optimus job ...`, `optimus node ...`, `optimus events`.

    optimus job status|pause|resume|stop|checkpoint|rewind --job NAME
    optimus node list|exclude|include|drain [NODE] --job NAME
    optimus events --job NAME           (follows, like tail -f; --no-follow prints and exits)

Every action is a request in the job's Redis stream, taken by the leading controller at its next
tick (controller/control/operator.py says what each does). The command checks first that the
request can be carried out (the same rule the controller applies), asks for confirmation on a
terminal (--yes skips it), sends it, and waits for the controller's answering event: it prints
that event and exits 0, or exits non-zero with one line saying why the request was refused.
--wait waits on for the effect (PAUSED, RUNNING again, STOPPED, a generation without the node).
Every command that changes something (these, and `optimus chaos`) takes --yes and --reason, so
scripts pass the same options to all of them.
Every output has `-o table` (rich, for people) and `-o json` (for scripts). What a table shows
comes from Redis or from users (nodes, hosts, reasons): it is escaped, never read as Rich markup.
"""

from __future__ import annotations

import getpass
import ipaddress
import json
import socket
import sys
import time

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import optimus.cli as core
from controller.cli import views
from controller.control import operator
from controller.control.view import PAUSED, RUNNING, STOPPED, TERMINAL
from controller.store import names
from controller.store.connect import fail_if_refused
from controller.store.store import Store, StoreUnavailable, redis_url, safe_url
from optimus.contract import env

ACK_TIMEOUT_S = 15.0  # a leading controller answers within a tick or two


class Refused(Exception):
    """The request cannot be carried out; the message says why."""


core.USER_ERRORS = (*core.USER_ERRORS, Refused)
main = core.main

job_option = click.option("--job", "job_name", envvar=env.JOB, required=True,
                          help="The job's name (`name` in its file); default $OPTIMUS_JOB.")
redis_option = click.option(
    "--redis", "redis", metavar="URL", default=None,
    help="redis:// or rediss:// URL (user:password@ for ACLs); default $REDIS_URL, else "
         "redis://127.0.0.1:6379/0.")
output_option = click.option("-o", "--output", type=click.Choice(["table", "json"]),
                             default="table", show_default=True)
yes_option = click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
wait_option = click.option("--wait/--no-wait", default=False, show_default=True,
                           help="Wait until the request has taken effect.")
timeout_option = click.option("--timeout", type=click.FloatRange(min=1), default=600.0,
                              show_default=True, help="Seconds --wait waits at most.")


def node_names(ctx, param, value):
    """A click callback: the node name(s) given, each a node name (controller/store/names.py)."""
    for name in value if isinstance(value, tuple) else [value]:
        if name is not None and (why := names.problem(name)) is not None:
            raise click.BadParameter(why)
    return value


def host_address(ctx, param, value):
    """A click callback: an address other hosts reach this one at, a hostname (the node-name
    rule: controller/store/names.py) or an IP address; None: not given."""
    if value is None:
        return None
    if names.is_node_name(value):
        return value
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise click.BadParameter(f"{names.shown(value)} is neither a hostname ({names.RULE}) "
                                 "nor an IP address") from None


def interface_name(ctx, param, value):
    """A click callback: a network interface's name (optimus/runtime/network.py's rule); None:
    not given."""
    from optimus.runtime.network import INTERFACE

    if value is None or INTERFACE.match(value):
        return value
    raise click.BadParameter(f"{names.shown(value)} is not an interface name (up to 15 "
                             "letters, digits, '_', '.', '-'): give one `ip link` lists")


def reason_option(required: bool = False):
    return (click.option("--reason", required=True, help="Why (recorded in the event). Required.")
            if required else click.option("--reason", default="",
                                          help="Why (recorded in the event)."))


def request_options(*, reason_required: bool = False, wait: bool = True):
    """The options every request command shares, in one order."""
    options = [job_option, redis_option, reason_option(reason_required), yes_option,
               *([wait_option, timeout_option] if wait else []), output_option]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command
    return apply


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _store(redis: str | None, job_name: str) -> tuple[Store, dict[str, str]]:
    url = redis_url(redis)
    fail_if_refused(url)  # nothing listens: say so now, not after the store's retries
    store = Store(url, job_name)
    record = store.job_record()
    if not record.get("state"):
        raise Refused(f"no job {job_name!r} in Redis at {safe_url(url)}; fix: --job is the `name` "
                      "in the job file, and --redis (or $REDIS_URL) the URL the controller uses")
    return store, record


def actor() -> tuple[str, str]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return user, socket.gethostname()


def confirm(yes: bool, question: str) -> None:
    """Ask on a terminal, unless --yes; never in a script (stdin is not a terminal)."""
    if not yes and sys.stdin.isatty():
        click.confirm(question, abort=True)


def _send(store: Store, record: dict[str, str], action: str, *, reason: str, node: str = "",
          checkpoint: bool = False, **more) -> dict:
    """Check, send, and wait for the controller's answer (its event); that event. `more`: the
    request's own fields (a rewind's to, skip, samples)."""
    entries = store.excluded()
    why = operator.refusal(
        action, record.get("state", ""), record.get("desired") or None, node=node,
        known_nodes=frozenset(store.nodes()) | frozenset(entries),
        excluded={n: e.get("reason", "") for n, e in entries.items()},
        draining=frozenset(n for n, e in entries.items() if e.get("mode") == "drain"),
        to=more.get("to"), skip=more.get("skip"))
    if why is not None:
        raise Refused(f"{action} refused: {why}")
    last = store.events_tail(1)
    after = last[-1][0] if last else "0"
    user, host = actor()
    fields = {"node": node} if node else {}
    if checkpoint:
        fields["checkpoint"] = True
    if more.get("skip"):
        more = {**more, "skip": "{}:{}".format(*more["skip"])}
    fields.update({k: v for k, v in more.items() if v is not None})
    rid = store.request(action, user, host, reason, **fields)
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while time.monotonic() < deadline:
        for event_id, event in store.events(after=after):
            after = event_id
            if event.get("request") == rid:
                if event.get("kind") == "refused":
                    raise Refused(event.get("message", f"{action} refused"))
                return {"id": event_id, **event}
        time.sleep(0.1)
    raise Refused(f"no controller answered request {rid} within {ACK_TIMEOUT_S:g} s (it stays "
                  "queued and is taken when one leads); fix: check that `optimus controller` "
                  "runs for this job against the same Redis")


def _report(output: str, event: dict, waited: str | None = None) -> None:
    if output == "json":
        click.echo(json.dumps({"accepted": True, "event": event,
                               **({"now": waited} if waited else {})}))
        return
    console = _console()
    console.print(f"{event['message']}", markup=False)
    if waited:
        console.print(waited, markup=False)


def _wait_state(store: Store, wanted: tuple[str, ...], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = store.job_record()
        if record.get("state") in wanted:
            return f"job {record['state']}: {record.get('reason', '')}"
        if record.get("state") in TERMINAL:
            raise Refused(f"the job ended {record['state']} instead: {record.get('reason')}")
        time.sleep(0.2)
    raise Refused(f"timed out after {timeout:g} s waiting for {' or '.join(wanted)}")


# --- optimus job ----------------------------------------------------------------------------------

@main.group()
def job() -> None:
    """See a job, and pause, resume, stop or checkpoint it."""


@job.command("status")
@job_option
@redis_option
@output_option
def job_status(job_name: str, redis: str | None, output: str) -> None:
    """The job's state, progress, restarts and nodes."""
    store, record = _store(redis, job_name)
    status = views.status(store, record)
    if output == "json":
        click.echo(json.dumps(status))
        return
    table = Table(title=f"job {escape(job_name)}", show_header=False, title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value")
    for key, value in status.items():
        if value in (None, "", [], {}):
            continue
        if key == "peak_memory":
            value = views.memory_text(value)
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value))
        table.add_row(key.replace("_", " "), escape(str(value)))
    _console().print(table)


@job.command("pause")
@click.option("--checkpoint", is_flag=True, help="Save a checkpoint of the step first.")
@request_options()
def job_pause(job_name, redis, checkpoint, reason, yes, wait, timeout, output) -> None:
    """Every rank stops after the same step (after a checkpoint of it, with --checkpoint)."""
    store, record = _store(redis, job_name)
    confirm(yes, f"Pause job {job_name}" + (" after a checkpoint" if checkpoint else "") + "?")
    event = _send(store, record, "pause", reason=reason, checkpoint=checkpoint)
    _report(output, event, _wait_state(store, (PAUSED,), timeout) if wait else None)


@job.command("resume")
@request_options()
def job_resume(job_name, redis, reason, yes, wait, timeout, output) -> None:
    """The ranks go on with the next step."""
    store, record = _store(redis, job_name)
    confirm(yes, f"Resume job {job_name}?")
    event = _send(store, record, "resume", reason=reason)
    _report(output, event, _wait_state(store, (RUNNING,), timeout) if wait else None)


@job.command("stop")
@request_options(reason_required=True)
def job_stop(job_name, redis, reason, yes, wait, timeout, output) -> None:
    """The ranks save a checkpoint and exit; the job ends STOPPED."""
    store, record = _store(redis, job_name)
    confirm(yes, f"Stop job {job_name} (the ranks save a checkpoint, then exit)?")
    event = _send(store, record, "stop", reason=reason)
    _report(output, event, _wait_state(store, (STOPPED,), timeout) if wait else None)


@job.command("checkpoint")
@request_options()
def job_checkpoint(job_name, redis, reason, yes, wait, timeout, output) -> None:
    """Every rank saves a checkpoint after its next step."""
    store, record = _store(redis, job_name)
    confirm(yes, f"Checkpoint job {job_name} after its next step?")
    # the step in progress now: the save comes after it
    asked_at = store.summaries.furthest_step() or 0
    event = _send(store, record, "checkpoint", reason=reason)
    waited = None
    if wait:
        deadline = time.monotonic() + timeout
        while int(store.job_record().get("latest_checkpoint") or -1) < asked_at:
            if time.monotonic() > deadline:
                raise Refused(f"timed out after {timeout:g} s waiting for the checkpoint")
            time.sleep(0.2)
        waited = (f"checkpoint of step {store.job_record()['latest_checkpoint']} committed "
                  f"(asked at step {asked_at})")
    _report(output, event, waited)


# --- optimus node ---------------------------------------------------------------------------------

@main.group()
def node() -> None:
    """List a job's nodes; exclude, drain or include one."""


@node.command("list")
@job_option
@redis_option
@output_option
def node_list(job_name: str, redis: str | None, output: str) -> None:
    """Every node: its role, agent, health, ranks and step."""
    store, _ = _store(redis, job_name)
    rows = views.nodes(store)
    if output == "json":
        click.echo(json.dumps(rows))
        return
    table = Table(title=f"nodes of job {escape(job_name)}", title_justify="left")
    for column in ("node", "host", "role", "agent", "health", "ranks", "step", "note"):
        table.add_column(column)
    for r in rows:
        table.add_row(*(escape(str(r[k])) for k in ("node", "host", "role", "agent", "health",
                                                     "live_ranks")),
                      "" if r["step"] is None else str(r["step"]), escape(r["note"]))
    _console().print(table)


def _node_action(action: str, job_name: str, redis: str | None, name: str, reason: str,
                 yes: bool, wait: bool, timeout: float, output: str, question: str) -> None:
    store, record = _store(redis, job_name)
    confirm(yes, question)
    event = _send(store, record, action, reason=reason, node=name)
    waited = None
    if wait and action == "exclude":
        waited = _wait_without(store, name, timeout)
    _report(output, event, waited)


def _wait_without(store: Store, name: str, timeout: float) -> str:
    """Until a running generation leaves `name` out (or the job is not running it anyway)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record, plan = store.job_record(), store.plan() or {}
        if record.get("state") in TERMINAL:
            raise Refused(f"the job ended {record['state']}: {record.get('reason')}")
        if name not in plan.get("nodes", []) and record.get("state") in (RUNNING, PAUSED):
            return f"generation {plan.get('generation')} runs without {name}"
        if record.get("state") == "WAITING":
            return f"job WAITING: {record.get('reason', '')}"
        time.sleep(0.2)
    raise Refused(f"timed out after {timeout:g} s waiting for a generation without {name}")


@node.command("exclude")
@click.argument("name", callback=node_names)
@request_options(reason_required=True)
def node_exclude(name, job_name, redis, reason, yes, wait, timeout, output) -> None:
    """Take NAME out until `include`; if it runs ranks, checkpoint and restart without it."""
    _node_action("exclude", job_name, redis, name, reason, yes, wait, timeout, output,
                 f"Exclude node {name} from job {job_name} (if it runs ranks, the job saves a "
                 "checkpoint and restarts without it)?")


@node.command("drain")
@click.argument("name", callback=node_names)
@request_options(wait=False)
def node_drain(name, job_name, redis, reason, yes, output) -> None:
    """Keep NAME out of future generations; the running one is left alone."""
    _node_action("drain", job_name, redis, name, reason, yes, False, 0.0, output,
                 f"Drain node {name} of job {job_name} (out of the next generation)?")


@node.command("include")
@click.argument("name", callback=node_names)
@request_options(wait=False)
def node_include(name, job_name, redis, reason, yes, output) -> None:
    """Make an excluded or draining NAME usable again (a spare until a restart takes it)."""
    _node_action("include", job_name, redis, name, reason, yes, False, 0.0, output,
                 f"Include node {name} in job {job_name} again (a spare until a restart "
                 "takes it)?")


# --- optimus events -------------------------------------------------------------------------------

@main.command()
@job_option
@redis_option
@click.option("-n", "--lines", "count", type=click.IntRange(min=0), default=20,
              show_default=True, help="How many past events to show first.")
@click.option("--follow/--no-follow", default=True, show_default=True,
              help="Keep printing new events as they come, like tail -f (Ctrl-C ends).")
@click.option("--kind", "kinds", multiple=True, help="Only events of this kind (repeatable).")
@output_option
def events(job_name: str, redis: str | None, count: int, follow: bool, kinds: tuple[str, ...],
           output: str) -> None:
    """The job's events: every controller decision and operator action, with who and why."""
    store, _ = _store(redis, job_name)
    console = _console()

    def show(batch: list[tuple[str, dict]]) -> None:
        for event_id, e in batch:
            if kinds and e.get("kind") not in kinds:
                continue
            if output == "json":
                click.echo(json.dumps({"id": event_id, **e}), nl=True)
                continue
            stamp = time.strftime("%Y-%m-%d %H:%M:%S",
                                  time.localtime(float(e.get("time", 0))))
            by = f" (from {e['host']})" if e.get("host") else ""
            console.print(f"{stamp} [{e.get('actor', '?')}{by}] {e.get('kind')}: "
                          f"{e.get('message', '')}", markup=False)
        sys.stdout.flush()

    past = store.events_tail(count) if count else []
    show(past)
    if not follow:
        return
    after = past[-1][0] if past else (store.events_tail(1) or [("0", {})])[-1][0]
    try:
        while True:
            try:
                batch = store.read_events(after, block_ms=1000)
            except StoreUnavailable as e:
                console.print(f"Redis unavailable, retrying: {e}", markup=False)
                time.sleep(1.0)
                continue
            if batch:
                after = batch[-1][0]
                show(batch)
    except KeyboardInterrupt:
        return
