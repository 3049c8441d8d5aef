"""`optimus checkpoint list | inspect | verify | export`: look at checkpoints, hand them on.

list, inspect and verify never load torch; export (optimus/hf/export.py) loads it when it runs.

Every command (and `optimus eval`) finds its checkpoints the same way: `--dir DIR` (a job's
`checkpoint.dir`), or `--job JOB_FILE` (that job's checkpoint.dir, resolved as training resolves
it), or, with neither, the one run under ./runs that has checkpoints (`locate`). A STEP is a step
number or `latest` in that directory; the older form, a path (a checkpoint directory or one
`step_<n>` folder in it) in place of STEP, still works. A path that is not there raises
CheckpointError, which the top-level CLI prints as one line.
Checkpoints set aside (`<root>/quarantine/`, optimus/checkpoint/quarantine.py) are listed as
"quarantined" with their reason; `verify` names them but does not count them as damage (they are
out of use).

inspect, verify, export (and `optimus eval`) accept only a checkpoint the run's key
authenticates (optimus/checkpoint/trust.py): the key of --job's run, else the one beside the
checkpoint directory. `--trust-checkpoint` accepts one it does not (another run's, or one from
before checkpoints were signed); its files are still read without running code.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from optimus.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    UntrustedCheckpoint,
    committed_steps,
    is_committed,
    latest_committed,
    read_manifest,
    step_dir,
    step_of,
    verify,
)
from optimus.checkpoint.quarantine import QUARANTINE_NOTE, quarantined
from optimus.checkpoint.trust import Trust, key_file_for, run_key_file
from optimus.files import human_bytes

EXIT_PROBLEMS = 2
_output = click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
                       show_default=True)
RUNS = Path("runs")  # where a job's run_dir goes by default (runs/{name}), under the cwd


def where_options(command):
    """--dir and --job, which every command that reads checkpoints takes."""
    command = click.option("--job", type=click.Path(path_type=Path),
                           help="A job file: its checkpoint.dir.")(command)
    return click.option("--dir", "root", type=click.Path(path_type=Path),
                        help="The checkpoint directory (a job's checkpoint.dir); default: the "
                             "one run under ./runs with checkpoints.")(command)


trust_option = click.option(
    "--trust-checkpoint", "trust", is_flag=True,
    help="Accept a checkpoint this run's key does not authenticate (another run's, or one "
         "from before checkpoints were signed); its files are still read without running code.")


def trust_for(step_path: Path, job: Path | None, trust: bool) -> Trust:
    """What authenticates the checkpoint `step_path`: the key of --job's run, else the one
    beside its checkpoint directory; `trust`: --trust-checkpoint."""
    if job is None:
        return Trust(key_file_for(step_path.parent), any=trust)
    from optimus.config import load_job

    return Trust(run_key_file(load_job(job).resolved_run_dir), any=trust)


def _untrusted_note(step_path: Path, why: str | None) -> None:
    if why:
        click.echo(f"note: {step_path} was not written by this run: {why}; trusted "
                   "(--trust-checkpoint)", err=True)


def _step_argument(default: str | None):
    return click.argument("step", metavar="[STEP]", required=False, default=default)


def _is_step_dir(path: Path) -> bool:
    return (step_of(path) is not None or is_committed(path) or (path / MANIFEST).exists()
            or (path / QUARANTINE_NOTE).exists())


def _resolve(path: Path) -> tuple[Path, bool]:
    """(path, whether it is one step dir rather than a root); refuses what is not there."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: give a checkpoint directory (the job's "
                              "checkpoint.dir) or one of its step_<n> folders")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file: give a checkpoint directory or a step_<n> folder")
    return path, _is_step_dir(path)


def checkpoint_root(root: Path | None, job: Path | None) -> Path:
    """The checkpoint directory: --dir, else --job's checkpoint.dir, else the only
    ./runs/*/checkpoints there is (said on stderr, so that -o json stays clean)."""
    if root is not None and job is not None:
        raise CheckpointError("give --dir or --job, not both")
    if root is not None:
        return root
    if job is not None:
        from optimus.config import load_job

        return Path(load_job(job).resolved_checkpoint_dir)  # relative to the cwd, as training
    found = sorted(p for p in RUNS.glob("*/checkpoints") if p.is_dir())
    if len(found) == 1:
        click.echo(f"checkpoints: {found[0]} (the only run under ./{RUNS}; --dir or --job "
                   "picks another)", err=True)
        return found[0]
    which = (f"./{RUNS} holds {len(found)} runs with checkpoints ("
             + ", ".join(map(str, found)) + ")" if found
             else f"./{RUNS} holds no run with checkpoints")
    raise CheckpointError(f"which checkpoints? {which}: give --dir CHECKPOINT_DIR or --job "
                          "JOB_FILE")


def locate(step: str | None, root: Path | None, job: Path | None) -> tuple[Path, bool]:
    """(path, whether it is one step folder rather than a root) that STEP names: a number or
    `latest` in the checkpoint directory, None for the directory itself, or a path."""
    if step is not None and not (step == "latest" or step.isdigit()):
        if root is not None or job is not None:
            raise CheckpointError(f"{step} is a path: give it alone, or a step number (or "
                                  "`latest`) with --dir / --job")
        return _resolve(Path(step))
    path, _ = _resolve(checkpoint_root(root, job))
    if step is None:
        return path, False
    if step == "latest":
        latest = latest_committed(path)
        if latest is None:
            raise CheckpointError(f"{path} holds no committed checkpoint")
        return latest, True
    found = step_dir(path, int(step))
    if not found.is_dir():
        steps = ", ".join(map(str, committed_steps(path))) or "none"
        raise CheckpointError(f"{path} has no checkpoint of step {int(step)} "
                              f"(committed: {steps})")
    return found, True


def _step_dirs(root: Path) -> list[Path]:
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir()]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None)]


def _human_age(seconds: float) -> str:
    s = max(0, int(seconds))
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if s < limit:
            return f"{s // div}{unit}"
    return f"{s // 86400}d"


def _layout(layout) -> str:
    if isinstance(layout, dict):
        return " ".join(f"{k}={v}" for k, v in layout.items())
    return "-" if layout is None else str(layout)


def _data_state(manifest: dict):
    return manifest.get("data_state", manifest.get("data"))


def _row(path: Path, now: float) -> dict:
    files = [p for p in path.rglob("*") if p.is_file()]
    row = {"step": step_of(path), "path": str(path), "state": "partial", "tokens": None,
           "layout": None, "bytes": sum(p.stat().st_size for p in files),
           "committed_at": None, "age_s": now - path.stat().st_mtime}
    if is_committed(path):
        try:
            manifest = read_manifest(path)
        except CheckpointError as e:
            return {**row, "state": "damaged", "error": str(e)}
        committed_at = manifest.get("committed_at")
        row.update(step=manifest.get("step"), state="committed", tokens=manifest.get("tokens"),
                   layout=manifest.get("layout"), committed_at=committed_at,
                   age_s=now - committed_at if committed_at else row["age_s"])
    return row


def _quarantined_rows(root: Path, now: float) -> list[dict]:
    rows = []
    for q in quarantined(root):
        row = _row(Path(q["path"]), now)
        rows.append({**row, "step": q.get("step", row["step"]), "state": "quarantined",
                     "kind": q.get("kind"), "reason": q.get("reason"),
                     "quarantined_at": q.get("quarantined_at")})
    return rows


def _aside_line(r: dict) -> str:
    return (f"quarantined: step {r['step']} as {r['path']} ({r.get('kind')}): "
            f"{r.get('reason')}")


@click.group()
def checkpoint() -> None:
    """List, inspect, verify and export checkpoints."""


@checkpoint.command("list")
@click.argument("path", metavar="[DIR]", required=False)
@where_options
@_output
def list_checkpoints(path: str | None, root: Path | None, job: Path | None, output: str) -> None:
    """Every step folder of the checkpoint directory: committed, partial or quarantined;
    tokens, layout, size, age. (DIR in place of --dir: the older form.)"""
    if path is not None and (root is not None or job is not None):
        raise CheckpointError(f"give the directory once: {path}, or --dir / --job")
    path, single = locate(None, root, job) if path is None else _resolve(Path(path))
    now = time.time()
    rows = [_row(p, now) for p in ([path] if single else _step_dirs(path))]
    if not single:
        rows += _quarantined_rows(path, now)
    if output == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo(f"no checkpoints in {path}")
        return
    table = Table("step", "state", "tokens", "layout", "size", "age", title=str(path))
    for r in rows:
        tokens = "-" if r["tokens"] is None else f"{r['tokens']:,}"
        table.add_row(*(Text(str(v)) for v in (
            "-" if r["step"] is None else r["step"], r["state"], tokens, _layout(r["layout"]),
            human_bytes(r["bytes"]), _human_age(r["age_s"]))))
    Console(width=120).print(table)
    for r in rows:
        if r["state"] == "quarantined":
            click.echo(_aside_line(r))
        elif "error" in r:
            click.echo(f"damaged: {r['error']}")


@checkpoint.command("inspect")
@_step_argument("latest")
@where_options
@_output
@trust_option
def inspect_checkpoint(step: str, root: Path | None, job: Path | None, output: str,
                       trust: bool) -> None:
    """The manifest of checkpoint STEP (a step number, or `latest`: the default)."""
    path, single = locate(step, root, job)
    if not single:
        latest = latest_committed(path)
        if latest is None:
            raise CheckpointError(f"{path} holds no committed checkpoint: nothing to inspect")
        path = latest
    manifest, untrusted = trust_for(path, job, trust).manifest(path)
    _untrusted_note(path, untrusted)
    if output == "json":
        click.echo(json.dumps(manifest, indent=2))
        return
    files = manifest["files"]
    total = sum(f["size"] for f in files.values())
    committed_at = manifest.get("committed_at")
    when = "-" if committed_at is None else (
        f"{datetime.fromtimestamp(committed_at, UTC):%Y-%m-%d %H:%M:%S} UTC "
        f"({_human_age(time.time() - committed_at)} ago)")
    tokens = manifest.get("tokens")
    data_state = _data_state(manifest)
    shown = {"format", "step", "tokens", "layout", "config_hash", "data_state", "data", "files",
             "committed_at"}
    lines = [
        ("checkpoint", str(path)),
        ("step", manifest.get("step")),
        ("tokens", "-" if tokens is None else f"{tokens:,}"),
        ("layout", _layout(manifest.get("layout"))),
        ("config hash", manifest.get("config_hash", "-")),
        ("data state", "-" if data_state is None else json.dumps(data_state)),
        ("files", f"{len(files)}, {total:,} bytes ({human_bytes(total)})"),
        ("committed", when),
        ("also", ", ".join(k for k in manifest if k not in shown) or "-"),
    ]
    for key, value in lines:
        click.echo(f"{key + ':':<12} {value}")


@checkpoint.command("verify")
@_step_argument(None)
@where_options
@click.option("--sizes-only", is_flag=True, help="Compare sizes only; skip the sha256 pass.")
@trust_option
def verify_checkpoints(step: str | None, root: Path | None, job: Path | None,
                       sizes_only: bool, trust: bool) -> None:
    """Check every file of checkpoint STEP (default: of every committed one) against its
    manifest, and that the run's key authenticates the manifest; exit 2 with one line per
    problem."""
    path, single = locate(step, root, job)
    targets = [path] if single else [step_dir(path, s) for s in committed_steps(path)]
    aside = [] if single else _quarantined_rows(path, time.time())
    for r in aside:
        click.echo(_aside_line(r))
    if not targets:
        raise CheckpointError(f"{path} holds no committed checkpoint: nothing to verify"
                              + (f" ({len(aside)} quarantined)" if aside else ""))
    bad, authority = 0, trust_for(targets[0], job, trust)  # all in one checkpoint directory
    for target in targets:
        problems, untrusted = verify(target, deep=not sizes_only), None
        try:
            _, untrusted = authority.manifest(target)
        except UntrustedCheckpoint as e:
            problems.insert(0, f"untrusted: {e}")
        except CheckpointError:
            pass  # a manifest that cannot be read: verify says why
        for p in problems:
            click.echo(p)
        if problems:
            bad += 1
        else:
            files = read_manifest(target)["files"]
            total = sum(f["size"] for f in files.values())
            click.echo(f"ok: {target.name} ({len(files)} files, {human_bytes(total)})"
                       + (f"; not written by this run ({untrusted}), trusted" if untrusted
                          else ""))
    if bad:
        click.get_current_context().exit(EXIT_PROBLEMS)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _size(text: str) -> int:
    """"5GB", "500MB", "2GiB" or a byte count (decimal units, as Transformers reads them)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m[2].lower() not in _UNITS or float(m[1]) * _UNITS[m[2].lower()] < 1:
        raise click.BadParameter(f"{text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def resolve_step(step: str, root: Path | None, job: Path | None, what: str = "export") -> Path:
    """The committed step folder STEP names (of a checkpoint directory: its latest)."""
    path, single = locate(step, root, job)
    if single:
        return path
    latest = latest_committed(path)
    if latest is None:
        raise CheckpointError(f"{path} holds no committed checkpoint: nothing to {what}")
    return latest


@checkpoint.command("export")
@_step_argument("latest")
@where_options
@click.option("--format", "fmt", type=click.Choice(["hf"]), required=True,
              help="hf: a Hugging Face Transformers model folder.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="The folder to write (new or empty, unless --overwrite).")
@click.option("--max-shard-size", "max_shard", default="5GB", show_default=True,
              help="The largest safetensors file (a tensor larger than this gets its own).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace what is in --out.")
@trust_option
def export_checkpoint(step: str, root: Path | None, job: Path | None, fmt: str, out: Path,
                      max_shard: str, dtype: str, overwrite: bool, trust: bool) -> None:
    """Write checkpoint STEP as a model other tools load (Hugging Face Transformers).

    STEP is a step number or `latest` (the default), in --dir or in the job's checkpoint.dir.
    Tensors are read and
    written one at a time, so a model larger than this machine's memory exports too.
    """
    from optimus.hf import export_hf  # torch loads only here

    source = resolve_step(step, root, job)
    done = export_hf(source, out, max_shard_bytes=_size(max_shard),
                     dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype], overwrite=overwrite,
                     trust=trust_for(source, job, trust))
    shards = sum(f.endswith(".safetensors") for f in done.files)
    click.echo(f"exported {source} as {done.family.architecture} to {done.out}: "
               f"{shards} safetensors file(s), {', '.join(done.files)}")
    for note in done.notes:
        click.echo(f"note: {note}")
