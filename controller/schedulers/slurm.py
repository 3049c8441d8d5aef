"""`optimus submit slurm`: fill in deploy/slurm/optimus.sbatch for one job, print it or sbatch it.

    optimus submit slurm jobs/gpt-1.3b.yaml --nodes 4 --spares 1 --ranks-per-node 8 \\
        --partition gpu --time 12:00:00 --submit

The script asks Slurm for nodes + spares whole nodes. Every value is checked here, before Slurm
sees it: a mistake in a `#SBATCH` line is otherwise found hours later, when the job starts, or
never (sbatch ignores what follows a bad directive). Nodes the controller excluded in an earlier
run of this job (its journal, `<run_dir>/controller.json`, outlives the allocation's Redis
process) are left out with `--exclude`, so a resubmission does not land on them again; a
journal that names a node by anything but a node name (controller/store/names.py) is refused,
never written.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click

import optimus.cli as core
from controller.control.journal import read_journal
from optimus.config import (
    ConfigError,
    JobConfig,
    check_job,
    check_replica_nodes,
    load_job,
)

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "slurm" / "optimus.sbatch"
ACL_TEMPLATE = ROOT / "deploy" / "redis-users.acl"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
WORD = re.compile(r"[A-Za-z0-9_.+-]+")
HOSTLIST = re.compile(r"[A-Za-z0-9_.\-\[\],]+")
# minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]
TIME = re.compile(r"(?:(\d+)-(\d+)(?::(\d+))?(?::(\d+))?|(\d+)(?::(\d+))?(?::(\d+))?)")
STOP_WARNING_S = 120  # SIGUSR1 this long before the time limit: time to save a checkpoint


def _refused(what: str, fix: str) -> ConfigError:
    return ConfigError("optimus submit slurm", what, fix)


def render(template: str, values: dict[str, str]) -> str:
    """The template with every {{name}} replaced; a name without a value is a bug here."""
    missing = sorted(set(PLACEHOLDER.findall(template)) - set(values))
    if missing:
        raise AssertionError(f"no value for {', '.join(missing)} in {TEMPLATE}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def time_limit_s(text: str) -> int:
    """Seconds in a Slurm time limit, in any of the forms sbatch --time takes."""
    m = TIME.fullmatch(text)
    if not m:
        raise _refused(f"--time {text!r} is not a Slurm time limit",
                       "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    d, h, mi, s, minutes, ms, hs = (int(g) if g else 0 for g in m.groups())
    if m.group(1) is not None:
        return ((d * 24 + h) * 60 + mi) * 60 + s
    if m.group(7) is not None:  # H:M:S
        return (minutes * 60 + ms) * 60 + hs
    return minutes * 60 + ms


def known_bad(run_dir: Path) -> list[str]:
    """Nodes the controller excluded in earlier runs of the job, from its journal (a
    ConfigError when it names one by anything but a node name)."""
    return sorted(read_journal(run_dir / "controller.json").get("excluded") or {})


def _word(option: str, value: str | None, pattern: re.Pattern = WORD) -> str | None:
    if value is not None and not pattern.fullmatch(value):
        raise _refused(f"{option} {value!r} would not survive a #SBATCH line",
                       "letters, digits and _.+-" + (" (and hostlists like n[1-4],m2)"
                                                     if pattern is HOSTLIST else ""))
    return value


def _plain_path(what: str, path: Path) -> Path:
    """A path that goes into a #SBATCH line, which has no quoting: refuse what would split."""
    if re.search(r"[\s%'\"\\]", str(path)):
        raise _refused(f"{what} {str(path)!r} holds a space, quote, backslash or '%', which "
                       "a #SBATCH line cannot carry", "a plain path")
    return path


def sbatch_options(partition, time, account, exclude: list[str], requeue: bool) -> list[str]:
    lines = [f"--partition={partition}" if partition else "", f"--time={time}" if time else "",
             f"--account={account}" if account else "",
             f"--exclude={','.join(exclude)}" if exclude else "",
             "--requeue" if requeue else "--no-requeue"]
    return [f"#SBATCH {line}" for line in lines if line]


def fill(config: JobConfig, job: Path, overrides: list[str], *, nodes: int, spares: int,
         ranks_per_node: int, partition: str | None = None, time: str | None = None,
         account: str | None = None, exclude: tuple[str, ...] = (),
         requeue: bool = True) -> tuple[str, list[str]]:
    """The filled-in script and the nodes it excludes."""
    workdir = _plain_path("the working directory", Path.cwd())
    run_dir = _plain_path("run_dir", Path(config.resolved_run_dir).resolve())
    bad = sorted(set(known_bad(run_dir)) | {_word("--exclude", e, HOSTLIST) for e in exclude})
    warning = STOP_WARNING_S if time is None else min(STOP_WARNING_S, time_limit_s(time) // 4)
    port = config.monitoring.metrics_port
    q = shlex.quote
    values = {
        "slurm_name": _word("the job's name", config.name),
        "allocation_nodes": str(nodes + spares), "output": f"{run_dir}/slurm-%j.out",
        "stop_warning_s": str(max(warning, 10)),
        "sbatch_options": "\n".join([f"#SBATCH --chdir={workdir}", *sbatch_options(
            _word("--partition", partition), time, _word("--account", account), bad,
            requeue)]),
        "job_file": q(str(job.resolve())), "job_name": q(config.name), "run_dir": q(str(run_dir)),
        "nodes": str(nodes), "ranks_per_node": str(ranks_per_node),
        "sets": " ".join(f"--set {q(o)}" for o in overrides), "python": q(sys.executable),
        "acl_template": q(str(ACL_TEMPLATE)),
        "agent_interval_s": str(config.supervision.heartbeat_interval_s),
        "stop_grace_s": str(config.supervision.stop_grace_s), "metrics_port": str(port),
        "standby_metrics_port": str(port + 1 if 0 < port < 65535 else 0),
    }
    return render(TEMPLATE.read_text(), values), bad


@click.command("slurm")
@core.job_argument
@core.set_option
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="Nodes that train.")
@click.option("--spares", type=click.IntRange(min=0), default=0, show_default=True,
              help="Extra nodes in the allocation, held back for restarts.")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--partition", default=None, help="Slurm partition (sbatch --partition).")
@click.option("--time", "time_", default=None, metavar="LIMIT",
              help="Time limit, as sbatch --time takes it (e.g. 12:00:00, 2-00).")
@click.option("--account", default=None, help="Account to charge (sbatch --account).")
@click.option("--exclude", multiple=True, metavar="NODES",
              help="Nodes to keep out besides those the controller excluded before "
                   "(repeatable; Slurm hostlists such as n[1-4] are fine).")
@click.option("--requeue/--no-requeue", default=True, show_default=True,
              help="Let Slurm requeue the job (node failure, preemption); it resumes from its "
                   "latest checkpoint with the same run directory.")
@click.option("--print", "mode", flag_value="print", default=True,
              help="Print the script (the default).")
@click.option("--submit", "mode", flag_value="submit",
              help="Write it to <run_dir>/optimus.sbatch and run sbatch on it.")
@click.option("--wait", is_flag=True,
              help="With --submit: wait for the job to end (sbatch --wait); exit with its code.")
def command(job: Path, overrides: tuple[str, ...], nodes: int, spares: int, ranks_per_node: int,
            partition: str | None, time_: str | None, account: str | None,
            exclude: tuple[str, ...], requeue: bool, mode: str, wait: bool) -> None:
    """Write the Slurm batch script for JOB: Redis, two controllers, one agent per node."""
    if not job.is_file():
        raise _refused(f"no job file {job}", "the path of a job YAML, e.g. jobs/tiny-gpt.yaml")
    config = load_job(job, list(overrides))
    check_job(config, world=nodes * ranks_per_node, source=str(job))
    check_replica_nodes(config, nodes, source=str(job))
    script, bad = fill(config, job, list(overrides), nodes=nodes, spares=spares,
                       ranks_per_node=ranks_per_node, partition=partition, time=time_,
                       account=account, exclude=exclude, requeue=requeue)
    if mode == "print":
        if wait:
            raise _refused("--wait waits for a submitted job", "add --submit")
        click.echo(script, nl=False)
        return
    sys.exit(_sbatch(script, Path(config.resolved_run_dir).resolve(), bad, wait))


def _sbatch(script: str, run_dir: Path, bad: list[str], wait: bool) -> int:
    """Write the script where the job's output goes, submit it; sbatch's exit code."""
    if shutil.which("sbatch") is None:
        raise _refused("sbatch is not on PATH", "run this on a Slurm login node, or --print "
                       "the script and submit it there")
    run_dir.mkdir(parents=True, exist_ok=True)  # Slurm writes the output file here
    path = run_dir / "optimus.sbatch"
    path.write_text(script)
    click.echo(f"script {path}; output {run_dir}/slurm-<jobid>.out"
               + (f"; excluded: {','.join(bad)}" if bad else ""), err=True)
    done = subprocess.run(["sbatch", *(["--wait"] if wait else []), str(path)])
    return done.returncode
