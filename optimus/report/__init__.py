"""`optimus report RUN_DIR`: one HTML page with PNG figures that tells a run's story in a minute.

It reads only the run directory (metrics.jsonl, events.jsonl, controller.json, the checkpoint
manifests), so it runs anywhere the directory can be read: during the run, after it, on another
machine. The figures need matplotlib (the `report` extra); reading the run does not.
"""

from __future__ import annotations

from pathlib import Path

from optimus.config import ConfigError
from optimus.report.runlog import Run, read_run

__all__ = ["Run", "build_report", "read_run"]


def build_report(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Render the report of `run_dir` into `out` (default `<run_dir>/report/`); the path of
    its index.html. DataError: no run there; ConfigError: matplotlib is not installed."""
    try:
        from optimus.report.page import build_report as build
    except ModuleNotFoundError as e:
        if e.name != "matplotlib" and not (e.name or "").startswith("matplotlib."):
            raise
        raise ConfigError("optimus report", "matplotlib is not installed",
                          "pip install 'optimus[report]'") from None
    return build(run_dir, out)
