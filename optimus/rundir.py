"""What a run directory says about the job that ran in it: its resolved configuration.

`optimus report` (optimus/report/runlog.py) and `optimus data audit` (a mixture run's seed) both
need it. The configuration is the newest committed checkpoint's (its manifest, `optimus.json`:
what the ranks trained), else the job file the controller's plan names (`controller.json`),
loaded with its overrides. Pure Python: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from optimus.checkpoint.manifest import CheckpointError, committed_steps, read_manifest, step_dir
from optimus.config import ConfigError, load_job

JOURNAL = "controller.json"  # the controller's journal: the job record, the last plan, exclusions


@dataclass
class RunConfig:
    config: dict | None = None  # the resolved job configuration, when the run dir holds it
    layout: dict | None = None  # the newest checkpoint's, with its world_size
    committed: list[int] = field(default_factory=list)  # steps with a committed checkpoint


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`; None where it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def run_config(run_dir: Path | str, journal: dict | None = None) -> RunConfig:
    """The run's configuration, layout and committed steps. `journal`: controller.json's
    contents, where the caller has read them already."""
    run_dir = Path(run_dir)
    if journal is None:
        journal = read_json(run_dir / JOURNAL) or {}
    plan = journal.get("plan") or {}
    job = None
    if plan.get("job_file"):
        try:
            job = load_job(plan["job_file"], list(plan.get("overrides") or []))
        except (ConfigError, OSError):
            job = None  # moved or changed since: the manifests may still say
    root = Path(job.resolved_checkpoint_dir) if job else run_dir / "checkpoints"
    found = RunConfig(committed=committed_steps(root) if root.is_dir() else [])
    if found.committed:
        try:
            manifest = read_manifest(step_dir(root, found.committed[-1]))
        except CheckpointError:  # damaged: the job file may still say
            manifest = {}
        found.config, found.layout = manifest.get("config"), manifest.get("layout")
        if found.layout and manifest.get("world_size"):
            found.layout = {**found.layout, "world_size": manifest["world_size"]}
    if found.config is None and job is not None:
        found.config = job.model_dump(mode="json")
    return found


def job_config(run_dir: Path | str) -> dict | None:
    """The run's resolved job configuration, where the run dir says it."""
    return run_config(run_dir).config
