"""The `optimus` command: one entry point, a subcommand for each job.

A user's mistake (bad job file, impossible layout, missing data) ends with one line on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import click
import yaml

from optimus import __version__
from optimus.checkpoint import CheckpointError
from optimus.commands.checkpoint import checkpoint, trust_option, where_options
from optimus.config import ConfigError, check_job, load_job
from optimus.contract import env
from optimus.contract.exits import EXIT_USER_ERROR
from optimus.data.errors import DataError
from optimus.runtime.launch import LaunchError

USER_ERRORS = (ConfigError, DataError, LaunchError, CheckpointError)


class _Group(click.Group):
    """Turns a user error raised anywhere below into one clear line."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(EXIT_USER_ERROR)


set_option = click.option(
    "--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
    help="Override one job setting, e.g. --set optim.lr=1e-3 (repeatable).")
job_argument = click.argument("job", type=click.Path(path_type=Path))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="optimus")
def main() -> None:
    """Optimus: fault-tolerant pretraining of dense and mixture-of-experts GPTs."""


@main.command()
@job_argument
@set_option
@click.option("--trust-checkpoint", "trust", is_flag=True,
              help="Resume from the newest checkpoint even if this run's key does not "
                   "authenticate it (another run's, or one from before checkpoints were signed); "
                   "its files are still read without running code.")
def train(job: Path, overrides: tuple[str, ...], trust: bool) -> None:
    """Train JOB as one rank (or as each rank under torchrun / srun / mpiexec)."""
    from optimus.parallel.float8 import check_float8_here
    from optimus.runtime.dist import forget_meshes
    from optimus.stability import RewindRequest
    from optimus.supervision import inprocess
    from optimus.supervision.exits import CheckpointFailed, NonFinite
    from optimus.train import train as run_training  # torch loads only when training

    config = load_job(job, list(overrides))
    check_float8_here(config, source=str(job))  # every rank, before the rendezvous
    inprocess.hold_sigterm()
    while True:  # one generation a turn: more only when its agent restarts it in process
        try:
            result = run_training(config, trust_checkpoint=trust)
            code = 0
            if (not inprocess.enabled() or getattr(result, "stopped_at", None) is None
                    or os.environ.get(env.QUORUM_FILE)):
                return  # trained to the end, or stopped with no agent to wait for (or as a
                # replica: its ranks wait in process only for its next launch, not generation)
            print(f"generation {_generation()} stopped after step {result.stopped_at}; "
                  "this rank waits in process for the next", flush=True)
        except (NonFinite, CheckpointFailed) as e:  # the agent reads the status (87, 88, 89)
            click.secho(f"error: {e}", fg="red", err=True)
            _abandon_helpers()
            sys.exit(e.exit_code)
        except RewindRequest as e:  # every rank alike: the controller reads the line (90)
            print(e.line(), flush=True)
            if not os.environ.get(env.AGENT_SOCKET):  # no controller to plan it
                click.secho(f"error: {e}; a rewind is planned by the controller (optimus run). "
                            "Here: resume with OPTIMUS_SKIP_STEPS=FIRST-LAST set to the steps "
                            "whose batches to skip, after moving aside the checkpoints from "
                            "FIRST on; or set stability.on_spike to skip_step or warn",
                            fg="red", err=True)
            if not inprocess.enabled():
                _abandon_helpers()
                sys.exit(e.exit_code)
            code = e.exit_code  # a clean rank: it waits in process for the rewound generation
        except Exception as e:  # a bad job (said in one line, exit 2), a peer died...
            if not (inprocess.enabled() and inprocess.peer_failure(e)):
                _abandon_helpers()
                raise
            code = 1  # what it would exit with; its log says why (the agent sends the tail)
            traceback.print_exc()
            print(f"{_launch()} ended under this rank: a peer is gone; this rank waits in "
                  "process for the next", flush=True)
        _abandon_helpers()
        forget_meshes()  # DTensor's cached decisions name the last generation's meshes
        # Ready first, then the generation's model, optimizer and loader freed (a collection
        # and a trim: ~0.2 s) while the controller plans the next one.
        word = inprocess.wait_for_next(code, config.supervision.heartbeat_interval_s,
                                       meanwhile=inprocess.release_memory)
        if word is None:
            return
        inprocess.enter(word)


def _generation() -> str:
    return os.environ.get(env.GENERATION, "?")


def _launch() -> str:
    """The generation, and under replicas that carry on, the replica's launch within it."""
    replica = os.environ.get(env.REPLICA)
    return f"generation {_generation()}" + (
        f" (replica {replica}, launch {os.environ.get(env.REPLICA_LAUNCH, '0')})"
        if replica and os.environ.get(env.QUORUM_FILE) else "")


def _abandon_helpers() -> None:
    """A failing rank must exit now, not when its helper processes would let it: at exit
    Python joins every non-daemonic multiprocessing child, and DCP's checkpoint writer process
    may be blocked in its own rendezvous with a peer that died (for its process group's whole
    timeout). Meanwhile the rank sends no heartbeat, and its healthy node would be taken for
    the culprit. Whatever such a helper was writing is not committed and is cleaned up later."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()


@main.group()
def config() -> None:
    """Inspect and validate job files."""


def least_world(cfg) -> int:
    """The fewest ranks the job's layout runs on: dp x cp x tp x pp, where dp: -1 (whatever
    the world leaves) takes the least that holds ep, whose ranks experts borrow from dp and
    cp (ep / cp of them from dp)."""
    p = cfg.parallel
    return (p.dp if p.dp > 0 else max(1, p.ep // p.cp)) * p.cp * p.tp * p.pp


world_option = click.option(
    "--world", type=click.IntRange(min=1),
    help="Number of ranks [default: the fewest the job's layout runs on].")


@config.command("show")
@job_argument
@set_option
@world_option
@click.option("-o", "--output", type=click.Choice(["yaml", "json"]), default="yaml")
def config_show(job: Path, overrides: tuple[str, ...], world: int | None, output: str) -> None:
    """Print JOB's resolved configuration, defaults and overrides included; with --world,
    parallel.dp as that world resolves it (without, as the file says: -1 is whatever the
    world leaves)."""
    cfg = load_job(job, list(overrides), world=world)
    resolved = cfg.model_dump(mode="json")
    if world is not None:
        layout = check_job(cfg, world=world, source=str(job))
        resolved["parallel"]["dp"] = layout.dp
    if output == "json":
        click.echo(json.dumps(resolved, indent=2))
    else:
        click.echo(yaml.safe_dump(resolved, sort_keys=False), nl=False)


@config.command("check")
@job_argument
@set_option
@world_option
@click.option("--machine", help="A machine profile (optimus plan's table): refuse a job whose "
              "ranks would not fit its device memory.")
@click.option("--machines", type=click.Path(path_type=Path),
              help="A YAML file of more machine profiles.")
@click.option("--memory-gib", type=click.FloatRange(min=0, min_open=True),
              help="Refuse a job whose ranks need more than this (overrides the profile's).")
def config_check(job: Path, overrides: tuple[str, ...], world: int | None, machine: str | None,
                 machines: Path | None, memory_gib: float | None) -> None:
    """Validate JOB and its layout for a world of N ranks (and its memory on a device)."""
    cfg = load_job(job, list(overrides))
    which = "" if world else " (the fewest its layout runs on; --world N checks another)"
    world = world or least_world(cfg)
    layout = check_job(cfg, world=world, source=str(job))
    if machine or memory_gib:
        from optimus.planner.fit import check_fits, job_precision
        from optimus.planner.machines import get_machine

        profile = get_machine(machine, machines) if machine else None
        capacity = memory_gib or profile.usable_gib
        device = profile.name if profile else "a device"
        if profile and not memory_gib and profile.headroom_gib:
            device += f" ({profile.memory_gib:g} GiB less {profile.headroom_gib:g} of headroom)"
        memory = check_fits(cfg, layout, capacity, device, job_precision(
            cfg, profile.precision if profile else "bf16"), source=str(job))
    d = cfg.data
    per_rank = d.batch_size // (layout.dp * d.microbatches)
    ranks = f"{world} rank" + ("s" if world > 1 else "")
    click.echo(f"ok: {job} on {ranks}{which}: dp={layout.dp} tp={layout.tp} pp={layout.pp} "
               f"ep={layout.ep} virtual_stages={layout.virtual_stages} cp={layout.cp}"
               + (f" ({cfg.parallel.cp_method}, {cfg.parallel.cp_split})" if layout.cp > 1
                  else "") + f"; {d.microbatches} "
               f"microbatch(es) of {per_rank} sequence(s) per dp replica per step")
    if d.sources:  # the shares as weights ask; the run's start-up event has the realised ones
        total = sum(s.weight for s in d.sources)
        click.echo(f"data: a mixture of {len(d.sources)} source(s): " + ", ".join(
            f"{s.path} {s.weight / total:.1%}" for s in d.sources))
    if machine or memory_gib:
        need = memory.total / 2**30
        need = f"{need:.1f} GiB" if need >= 1 else f"{need * 1024:.0f} MiB"
        click.echo(f"memory: {need} per rank at most, of {capacity:g} "
                   f"GiB on {device} (`optimus plan --explain` shows every term)")


@main.command()
@job_argument
@set_option
@click.option("--devices", type=click.IntRange(min=1), required=True,
              help="Devices (ranks) to plan for.")
@click.option("--machine", help="Machine profile, e.g. a100-hdr, h100-ndr [default: the "
              "profile of the job's parallel.device; h100-ndr for auto (docs/planner.md)].")
@click.option("--machines", type=click.Path(path_type=Path),
              help="A YAML file of more machine profiles.")
@click.option("--memory-gib", type=click.FloatRange(min=0, min_open=True),
              help="Device memory to plan within (default: the profile's).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--explain", "explain_layout", metavar="LAYOUT",
              help="Show every term of one layout, named as the table names it.")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table")
def plan(job: Path, overrides: tuple[str, ...], devices: int, machine: str | None,
         machines: Path | None, memory_gib: float | None, top: int,
         explain_layout: str | None, output: str) -> None:
    """Rank JOB's layouts on N devices by predicted tokens/s, dropping those that do not fit."""
    from rich.console import Console

    from optimus.planner import report, search
    from optimus.planner.fit import job_precision
    from optimus.planner.machines import default_machine, get_machine
    from optimus.planner.memory import shape_of
    from optimus.planner.steptime import step_time

    cfg = load_job(job, list(overrides))
    chosen = machine or default_machine(cfg.parallel.device)
    if not machine:  # on stderr: -o json stays one document
        click.echo(f"machine: {chosen} (for parallel.device: {cfg.parallel.device}; --machine "
                   "picks another)", err=True)
    profile = get_machine(chosen, machines)
    precision = job_precision(cfg, profile.precision)
    capacity = memory_gib or profile.usable_gib
    room = (f" ({profile.memory_gib:g} GiB less {profile.headroom_gib:g} of headroom: allocator, "
            "collective buffers, context)" if not memory_gib and profile.headroom_gib else "")
    if explain_layout:
        lay = search.parse_layout(explain_layout, cfg, precision)
        shape = shape_of(cfg.model)
        found = search.Candidate(lay, search.worst_rank(shape, lay),
                                 step_time(cfg.model, lay, profile, cfg.data.batch_size))
        if output == "json":
            click.echo(json.dumps({**report.as_dict(found), "rates": report.rates_dict(profile),
                                   "stack": report.stack_lines(lay.compiled)}, indent=2))
        else:
            report.explain(found, capacity, Console(width=None if sys.stdout.isatty() else 160),
                           room, profile)
        return
    fits, seen = search.plan(cfg, devices, profile, precision, capacity)
    if output == "json":
        click.echo(json.dumps({"devices": devices, "machine": profile.name, "considered": seen,
                               "rates": report.rates_dict(profile),
                               "fit": len(fits), "capacity_gib": capacity,
                               "headroom_gib": 0.0 if memory_gib else profile.headroom_gib,
                               "layouts": [report.as_dict(c)
                                                             for c in fits[:top]]}, indent=2))
        return
    if not seen:
        raise ConfigError(str(job), f"no layout splits this job over {devices} devices (tp "
                          "must divide the heads, ffn_dim and vocabulary and fit a node; dp "
                          f"must divide data.batch_size={cfg.data.batch_size})",
                          "choose a device count that divides the batch, e.g. a power of two")
    if not fits:
        raise ConfigError(str(job), f"none of {seen} layouts on {devices} devices fits "
                          f"{profile.name}'s {capacity:g} GiB{room}",
                          "plan for more devices, or a smaller data.batch_size or model")
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(report.header(profile), soft_wrap=True)
    console.print(report.table(fits[:top], f"{cfg.name} on {devices} x {profile.name}: "
                               f"{len(fits)} of {seen} layouts fit {capacity:g} GiB{room}"))


@main.group()
def data() -> None:
    """Prepare training data."""


@data.command("prepare")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Folder for the token shards and index.json.")
@click.option("--tokenizer", default="byte", show_default=True,
              help="`byte`, or the path of a Hugging Face tokenizer.json (or its folder).")
@click.option("--dtype", type=click.Choice(["auto", "uint16", "uint32"]), default="auto",
              show_default=True, help="Token width on disk; auto: uint16 if the vocab fits.")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=2**26, show_default=True,
              help="Most tokens per shard file; each input file starts its own shards.")
@click.option("--text-key", default="text", show_default=True,
              help="The JSON field, or parquet column, that holds the text.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes, one input file each at a time [default: one per CPU].")
@click.option("--holdout", type=click.FloatRange(min=0, max=1, max_open=True), default=0.0,
              show_default=True, help="Fraction of documents set aside in OUT/holdout/ (a "
              "prepared folder of its own, for eval.path), chosen by a hash of their text.")
@click.option("--overwrite", is_flag=True,
              help="Delete what an earlier prepare wrote to --out and start over.")
def data_prepare(inputs, out_dir, tokenizer, dtype, shard_tokens, text_key, workers, holdout,
                 overwrite) -> None:
    """Tokenize INPUTS (files, folders, glob patterns) into token shards in --out.

    Reads .txt (one document per file), JSON lines (.jsonl, .jsonl.gz, .jsonl.zst, and
    .json.gz / .json.zst as Dolma-style corpora name them: one document per line) and
    .parquet (one per row). Every document ends with the tokenizer's end-of-document token.
    Killed or failed, it continues when run again with the same arguments: finished input
    files are kept, never rewritten. See docs/data.md."""
    from optimus.data.prepare import prepare

    summary = prepare(list(inputs), out_dir, tokenizer=tokenizer, dtype=dtype,
                      shard_tokens=shard_tokens, text_key=text_key, overwrite=overwrite,
                      workers=workers, holdout=holdout, progress=True)
    click.echo(f"wrote {summary['total_tokens']:,} tokens of {summary['num_documents']:,} "
               f"documents in {len(summary['shards'])} shard(s) ({summary['dtype']}) to "
               f"{out_dir}")
    if "holdout" in summary:
        held = summary["holdout"]["num_documents"]
        click.echo(f"held out {held:,} documents in {out_dir / 'holdout'}"
                   + ("" if held else ": none; raise --holdout (and pass --overwrite)"))


@data.command("audit")
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True)
def data_audit(run_dir: Path, output: str) -> None:
    """Check that the run read every sample exactly once, across its restarts; exit 2 if not.

    Reads RUN_DIR/metrics.jsonl: each step's sample-index range and ids' hash, as every
    generation appended them (a restart's steps supersede the ones it rolled back). For a
    mixture, also the share of the samples read from each source beside its weight's."""
    from optimus.data.audit import audit_run

    result = audit_run(run_dir)
    if output == "json":
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        for line in result.lines():
            click.echo(line)
    if not result.ok:
        sys.exit(EXIT_USER_ERROR)


@main.command("eval")
@click.argument("step", metavar="[CHECKPOINT]", required=False, default="latest")
@click.option("--data", type=click.Path(path_type=Path),
              help="Prepared held-out tokens (e.g. the holdout/ folder of `optimus data "
                   "prepare --holdout`); omit for a synthetic-data job's held-out stream.")
@where_options
@click.option("--batches", type=click.IntRange(min=1), default=4, show_default=True,
              help="Global batches of data.batch_size sequences of data.seq_len tokens.")
@set_option
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True)
@trust_option
def evaluate_command(step: str, data: Path | None, root: Path | None, job: Path | None,
                     batches: int, overrides: tuple[str, ...], output: str, trust: bool) -> None:
    """Validation loss and perplexity of a committed checkpoint, on any layout.

    CHECKPOINT is a step number or `latest` (the default) in --dir, in --job's checkpoint.dir
    or in the one run under ./runs, or the path of a step folder. One process by default;
    under torchrun (or srun, mpiexec) each rank runs it, data parallel over all of them, or
    the layout --set parallel.tp=2 --set parallel.pp=2 ... asks for. The model and data shapes
    are the checkpoint's own."""
    from optimus.commands.checkpoint import resolve_step, trust_for
    from optimus.evaluate import evaluate_checkpoint  # torch loads only here

    path = resolve_step(step, root, job, what="evaluate")
    result, manifest, rank = evaluate_checkpoint(path, data=str(data) if data else None,
                                                 batches=batches, overrides=list(overrides),
                                                 trust=trust_for(path, job, trust))
    if rank != 0:
        return
    if manifest.get("untrusted"):
        click.echo(f"note: {path} was not written by this run: {manifest['untrusted']}; "
                   "trusted (--trust-checkpoint)", err=True)
    if output == "json":
        click.echo(json.dumps({"checkpoint": str(path), "step": manifest.get("step"),
                               "data": str(data) if data else "synthetic held-out",
                               **result.fields()}))
        return
    click.echo(f"{path} (step {manifest.get('step')}): validation loss {result.loss:.4f}, "
               f"perplexity {result.perplexity:.2f}, on {result.tokens:,} held-out tokens of "
               f"{data or 'the synthetic held-out stream'} ({result.seconds:.1f} s)")


@main.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for index.html and its PNGs; default RUN_DIR/report.")
def report(run_dir: Path, out_dir: Path | None) -> None:
    """Render RUN_DIR's report: one HTML page with figures (loss, throughput, the control
    plane's timeline, checkpoint saves) and a table of the run's facts."""
    from optimus.report import build_report

    click.echo(f"report: {build_report(run_dir, out_dir)}")


main.add_command(checkpoint)
