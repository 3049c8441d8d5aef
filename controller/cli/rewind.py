"""`optimus job rewind`: an operator's rewind, the same the controller makes for a loss spike
(controller/control/rewind.py).

    optimus job rewind --job NAME --to STEP [--skip-steps A:B | --skip-samples N] --reason WHY

The running generation stops without saving; the next resumes from the newest memory snapshot
or committed checkpoint at or before STEP (the newer checkpoints are set aside: quarantine keeps
them, docs/checkpoints.md), skipping the batches of steps A..B (or of the steps after STEP
that hold N samples, rounded up to whole steps). `optimus data audit` accounts the skipped
samples. --wait waits for the rewound generation to run.
"""

from __future__ import annotations

import time

import click

from controller.cli import ops
from controller.control.view import PAUSED, PAUSING, RUNNING


def _window(ctx, param, value: str | None) -> tuple[int, int] | None:
    """A:B, whole steps, 1 <= A <= B."""
    if value is None:
        return None
    first, _, last = value.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)
            and len(value) < 26):
        raise click.BadParameter(f"{value!r} is not A:B, steps with 1 <= A <= B (e.g. 1200:1260)")
    return int(first), int(last)


@ops.job.command("rewind")
@click.option("--to", "to", type=click.IntRange(min=0), required=True,
              help="The newest step to resume from (0: from scratch).")
@click.option("--skip-steps", "skip", metavar="A:B", callback=_window,
              help="Skip the batches of steps A..B (after --to).")
@click.option("--skip-samples", "samples", type=click.IntRange(min=1),
              help="Skip the N samples after --to (whole steps' batches, rounded up).")
@ops.request_options(reason_required=True)
def job_rewind(to: int, skip: tuple[int, int] | None, samples: int | None, job_name: str,
               redis: str | None, reason: str, yes: bool, wait: bool, timeout: float,
               output: str) -> None:
    """Go back to step --to without saving, skipping a window of batches."""
    if skip is not None and samples is not None:
        raise ops.Refused("--skip-steps and --skip-samples both name the window to skip: give "
                          "one of them")
    store, record = ops._store(redis, job_name)
    now = store.summaries.furthest_step()
    if now is not None and to > now:
        raise ops.Refused(f"rewind refused: step {to} is ahead of the job (at step {now}); fix: "
                          f"--to {now} or earlier")
    what = (f", skipping the batches of steps {skip[0]}..{skip[1]}" if skip else
            f", skipping the {samples} samples after it" if samples else "")
    ops.confirm(yes, f"Rewind job {job_name} to step {to}{what} (the running generation stops "
                "without saving)?")
    generation = int(record.get("generation", -1))
    event = ops._send(store, record, "rewind", reason=reason, to=to, skip=skip,
                      samples=samples)
    ops._report(output, event, _wait_rewound(store, generation, timeout) if wait else None)


def _wait_rewound(store, generation: int, timeout: float) -> str:
    """Until a generation after `generation` runs (or pauses: a paused job stays so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = store.job_record()
        if int(record.get("generation", -1)) > generation and \
                record.get("state") in (RUNNING, PAUSING, PAUSED):
            return f"job {record['state']}: {record.get('reason', '')}"
        time.sleep(0.2)
    raise ops.Refused(f"timed out after {timeout:g} s waiting for the rewound generation")
