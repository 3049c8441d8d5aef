"""`optimus submit pbs`: deploy/pbs/optimus.pbs filled in for one job, printed or given to qsub.

The script stays the one source of truth, submittable by hand: this module only rewrites its
`#PBS` lines and the defaults of its settings block (`OPTIMUS_X=${OPTIMUS_X:-value}`), after
checking every value, so that a typo is one line here rather than a job that dies in the queue
hours later. Values are refused rather than quoted: nothing the user types reaches the shell
or a `#PBS` line unless it matches a plain pattern. PBS has no --exclude: the script leaves out
the nodes the job excluded when it starts (asking Redis); the job's journal, from which a
controller may restore them, is checked here first (controller/control/journal.py), so that a
node name that is no node name stops the submission rather than the job.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from controller.control.journal import read_journal
from optimus.config import ConfigError, check_job, check_replica_nodes, load_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "pbs" / "optimus.pbs"

PLAIN = re.compile(r"^[A-Za-z0-9_.-]+$")  # queue and account names
FILESYSTEMS = re.compile(r"^[A-Za-z0-9_]+(:[A-Za-z0-9_]+)*$")  # Aurora: home:flare, ...
WALLTIME = re.compile(r"^(\d{1,3}):([0-5]\d):([0-5]\d)$")
SHELL_SAFE = re.compile(r"^[A-Za-z0-9_./+,:@=-]+$")  # paths written into ${VAR:-...}


@dataclass(frozen=True)
class PbsJob:
    """What one submission asks of PBS and of the script."""

    job_file: Path
    name: str
    nodes: int
    spares: int
    ranks_per_node: int
    queue: str | None
    walltime: str
    account: str | None
    filesystems: str | None
    pmi: str


def refuse(what: str, fix: str) -> ConfigError:
    return ConfigError("optimus submit pbs", what, fix)


def check(job: PbsJob) -> None:
    """Raise one ConfigError naming the first value PBS or the script would not take."""
    if job.queue is not None and not PLAIN.match(job.queue):
        raise refuse(f"--queue {job.queue!r} is not a queue name", "e.g. --queue prod")
    if job.account is not None and not PLAIN.match(job.account):
        raise refuse(f"--account {job.account!r} is not a project name", "e.g. --account MyProj")
    if job.filesystems is not None and not FILESYSTEMS.match(job.filesystems):
        raise refuse(f"--filesystems {job.filesystems!r} is not a list of file systems",
                     "names joined by colons, e.g. --filesystems home:flare")
    time = WALLTIME.match(job.walltime)
    if not time or not any(int(part) for part in time.groups()):
        raise refuse(f"--walltime {job.walltime!r} is not a duration", "HH:MM:SS, e.g. 06:00:00")
    for what, path in (("the job file", job.job_file), ("this Python", Path(sys.executable)),
                       ("the Optimus checkout", ROOT), ("the working directory", Path.cwd())):
        if not SHELL_SAFE.match(str(path)):
            raise refuse(f"{what} ({path}) has characters the script will not quote",
                         "move it to a path of letters, digits and ./_-")


def fill(template: str, job: PbsJob) -> str:
    """The script with this job's #PBS lines and settings; unknown #PBS lines stay as they are."""
    header = {"-N": job.name, "-l select=": str(job.nodes + job.spares),
              "-l walltime=": job.walltime, "-q": job.queue, "-A": job.account,
              "-l filesystems=": job.filesystems}
    settings = {"OPTIMUS_JOB_FILE": str(job.job_file), "OPTIMUS_NODES": str(job.nodes),
                "OPTIMUS_RANKS_PER_NODE": str(job.ranks_per_node), "OPTIMUS_PMI": job.pmi,
                "OPTIMUS_HOME": str(ROOT), "OPTIMUS_WORKDIR": str(Path.cwd()),
                "OPTIMUS_PYTHON": sys.executable}
    lines = []
    for line in template.splitlines():
        for key, value in header.items():
            if line.startswith(f"#PBS {key}"):
                sep = "" if key.endswith("=") else " "
                line = f"#PBS {key}{sep}{value}" if value is not None else None
                break
        for key, value in settings.items():
            prefix = f"{key}=${{{key}:-"
            if line and line.startswith(prefix):
                rest = line[len(prefix):]
                line = prefix + value + rest[_default_end(rest):]
        if line is not None:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _default_end(text: str) -> int:
    """Where the default that `text` starts with ends: at its closing brace, nested ones
    (`${PBS_O_WORKDIR:-$PWD}`) skipped."""
    depth = 0
    for i, char in enumerate(text):
        if char == "{":
            depth += 1
        elif char == "}":
            if depth == 0:
                return i
            depth -= 1
    raise ValueError(f"no closing brace in {text!r}")


def submit(script: str, job: PbsJob, run_dir: Path) -> str:
    """Write the script next to the run and give it to qsub; the PBS job id."""
    qsub = shutil.which("qsub")
    if qsub is None:
        raise refuse("qsub is not on PATH", "run this on a PBS login node, or use --print and "
                     "submit the script yourself")
    path = run_dir / "optimus.pbs"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    done = subprocess.run([qsub, str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise refuse(f"qsub refused {path}: {done.stderr.strip() or done.stdout.strip()}",
                     "check the queue, account and walltime against the site's limits")
    return done.stdout.strip()


@click.command("pbs")
@click.argument("job_file", metavar="JOB", type=click.Path(path_type=Path))
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="Nodes that run ranks.")
@click.option("--spares", type=click.IntRange(min=0), required=True,
              help="Extra nodes held back for restarts (select = nodes + spares).")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=12, show_default=True,
              help="Aurora: 12, one per tile.")
@click.option("--queue", default=None, help="PBS queue (-q); default the script's.")
@click.option("--walltime", default="01:00:00", show_default=True, help="HH:MM:SS.")
@click.option("--account", default=None, help="Project to charge (-A).")
@click.option("--filesystems", default=None, help="-l filesystems=, e.g. home:flare.")
@click.option("--pmi", type=click.Choice(["pals", "pmix"]), default="pals", show_default=True,
              help="pmix launches the agents with mpiexec --pmi=pmix.")
@click.option("--print/--submit", "only_print", default=True,
              help="Print the filled-in script (default), or submit it with qsub.")
def command(job_file: Path, nodes: int, spares: int, ranks_per_node: int, queue: str | None,
            walltime: str, account: str | None, filesystems: str | None, pmi: str,
            only_print: bool) -> None:
    """Fill in deploy/pbs/optimus.pbs for JOB (PBS Pro with PALS: Aurora); print or qsub it."""
    config = load_job(job_file)
    check_job(config, world=nodes * ranks_per_node, source=str(job_file))
    check_replica_nodes(config, nodes, source=str(job_file))
    job = PbsJob(job_file.resolve(), config.name, nodes, spares, ranks_per_node, queue,
                 walltime, account, filesystems, pmi)
    check(job)
    read_journal(Path(config.resolved_run_dir).resolve() / "controller.json")
    script = fill(SCRIPT.read_text(), job)
    if only_print:
        click.echo(script, nl=False)
        return
    click.echo(f"submitted {submit(script, job, Path(config.resolved_run_dir))}")
