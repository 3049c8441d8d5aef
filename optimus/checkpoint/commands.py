"""`optimus checkpoint list | inspect | verify`: look at checkpoints without loading torch.

Each command takes a checkpoint root (the job's `checkpoint.dir`) or one `step_<n>` folder in it.
A path that is not there raises CheckpointError, which the top-level CLI prints as one line.
Checkpoints set aside (`<root>/quarantine/`, quarantine.py) are listed as "quarantined" with
their reason; `verify` names them but does not count them as damage (they are out of use).
"""

from __future__ import annotations

import json
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
    committed_steps,
    is_committed,
    latest_committed,
    read_manifest,
    step_dir,
    step_of,
    verify,
)
from optimus.checkpoint.quarantine import QUARANTINE_NOTE, quarantined
from optimus.files import human_bytes

EXIT_PROBLEMS = 2
_output = click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
                       show_default=True)
_path_argument = click.argument("path", metavar="DIR_OR_STEP_DIR", type=click.Path(path_type=Path))


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
    """List, inspect and verify checkpoints."""


@checkpoint.command("list")
@click.argument("path", metavar="DIR", type=click.Path(path_type=Path))
@_output
def list_checkpoints(path: Path, output: str) -> None:
    """Every step folder in DIR: committed, partial or quarantined; tokens, layout, size, age."""
    path, single = _resolve(path)
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
@_path_argument
@_output
def inspect_checkpoint(path: Path, output: str) -> None:
    """The manifest of one checkpoint (of a root: its latest committed one)."""
    path, single = _resolve(path)
    if not single:
        latest = latest_committed(path)
        if latest is None:
            raise CheckpointError(f"{path} holds no committed checkpoint: nothing to inspect")
        path = latest
    manifest = read_manifest(path)
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
@_path_argument
@click.option("--sizes-only", is_flag=True, help="Compare sizes only; skip the sha256 pass.")
def verify_checkpoints(path: Path, sizes_only: bool) -> None:
    """Check every file against its manifest; exit 2 with one line per problem."""
    path, single = _resolve(path)
    targets = [path] if single else [step_dir(path, s) for s in committed_steps(path)]
    aside = [] if single else _quarantined_rows(path, time.time())
    for r in aside:
        click.echo(_aside_line(r))
    if not targets:
        raise CheckpointError(f"{path} holds no committed checkpoint: nothing to verify"
                              + (f" ({len(aside)} quarantined)" if aside else ""))
    bad = 0
    for target in targets:
        problems = verify(target, deep=not sizes_only)
        for p in problems:
            click.echo(p)
        if problems:
            bad += 1
        else:
            files = read_manifest(target)["files"]
            total = sum(f["size"] for f in files.values())
            click.echo(f"ok: {target.name} ({len(files)} files, {human_bytes(total)})")
    if bad:
        click.get_current_context().exit(EXIT_PROBLEMS)
