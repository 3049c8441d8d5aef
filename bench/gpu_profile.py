"""Where the trainer's step time goes against the plain loop's, on one device: torch.profiler.

`bench/mfu.py` measures the ratio (Optimus tokens/s over the hand-written loop's); this says
why it is below 1. For each mode asked, both sides run `--steps` steps with the profiler on
for the last `--active` (the loss read on the host every third step, as bench/mfu.py does);
printed per side: the step's wall time, the device's busy time in it (kernels and copies, from
the trace), the host-side sync points, and the ops that differ most between the two sides in
device time and in host time. `--trace DIR` also writes each side's
Chrome trace (gzip) for a closer look in Perfetto.

    python bench/gpu_profile.py --device cuda --modes eager-bf16-none,compiled-bf16-none

On a CPU (`--device cpu`, the small shape) it runs the same path, for checking the script.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import mfu  # noqa: E402  (bench/mfu.py: the same jobs, modes and weights)
import mfu_reference  # noqa: E402
from mfu_window import optimus_step_starts  # noqa: E402

from optimus.config import validate_job  # noqa: E402


class Stepper:
    """Calls `prof.step()` at each step start, and keeps each step's wall time."""

    def __init__(self, prof):
        self.prof, self.marks = prof, []

    def __call__(self) -> None:
        if self.prof.device_type == "cuda":
            torch.cuda.synchronize()
        self.marks.append(time.perf_counter())
        self.prof.step()


def profiler(device: torch.device, steps: int, active: int):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    prof = profile(activities=activities, schedule=schedule(
        wait=steps - active - 1, warmup=1, active=active), record_shapes=False)
    prof.device_type = device.type
    return prof


def optimus_profiled(bench, mode, prof) -> Stepper:
    from optimus.train import train

    stepper = Stepper(prof)
    with (tempfile.TemporaryDirectory(prefix="bench-prof-") as tmp, prof,
          optimus_step_starts(lambda step: stepper())):  # the start of each of train()'s steps
        train(validate_job(bench.job(mode, tmp), world=1), quiet=True)
        stepper()
    return stepper


class StepperWindow:
    """What the plain loop asks of its window (bench/mfu_window.py): a call at each step's
    start, here the profiler's step, and the logging cadence, bench/mfu.py's."""

    def __init__(self, stepper: Stepper, bench):
        self.stepper, self.logged = stepper, bench.window().logged

    def step_start(self, step: int) -> None:
        self.stepper()


def reference_profiled(bench, mode, weights, prof) -> Stepper:
    stepper = Stepper(prof)
    with prof:
        job = validate_job(bench.job(mode, "unused"), world=1)
        mfu_reference.reference_step_times(job, mode, bench.device, weights, bench.recipe,
                                           StepperWindow(stepper, bench))
        stepper()
    return stepper


def summarise(name: str, prof, stepper: Stepper, active: int) -> dict:
    # walls[i] is training step i + 1; the profiler's active window: the steps before the last
    marks = stepper.marks
    walls = [marks[i + 1] - marks[i] for i in range(len(marks) - 1)][-active - 1:-1]
    events = prof.key_averages()
    # Kernels, copies and memsets only: they have no host time. An op or a user annotation
    # (ProfilerStep*, FSDP::pre_forward) carries the device time of what it launched as well,
    # so summing every row counts it twice.
    device_us = sum(e.self_device_time_total for e in events if e.self_cpu_time_total == 0)
    syncs = {e.key: e.count for e in events if any(
        k in e.key for k in ("Synchronize", "item", "_local_scalar_dense", "is_nonzero"))}
    wall = statistics.median(walls) if walls else float("nan")
    busy = device_us / 1e6 / active
    print(f"\n--- {name}: step {wall * 1e3:.1f} ms wall, device busy {busy * 1e3:.1f} ms "
          f"({busy / wall:.1%} of the step); per step: " + ", ".join(
              f"{k} x{v / active:g}" for k, v in sorted(syncs.items())), flush=True)
    return {"wall_s": wall, "busy_s": busy,
            "device": {e.key: e.self_device_time_total / active for e in events},
            "host": {e.key: e.self_cpu_time_total / active for e in events},
            "counts": {e.key: e.count / active for e in events}}


def differences(ours: dict, ref: dict, field: str, top: int) -> None:
    keys = set(ours[field]) | set(ref[field])
    rows = sorted(keys, key=lambda k: -abs(ours[field].get(k, 0) - ref[field].get(k, 0)))
    print(f"  {field} time per step, largest differences (Optimus - reference, us):")
    for k in rows[:top]:
        a, b = ours[field].get(k, 0.0), ref[field].get(k, 0.0)
        print(f"    {a - b:+10.0f}  {a:10.0f} {b:10.0f}  x{ours['counts'].get(k, 0):g}/"
              f"x{ref['counts'].get(k, 0):g}  {k[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--modes", default="eager-bf16-none,compiled-bf16-none")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--active", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--trace", type=Path, help="folder for the Chrome traces (gzip)")
    args = p.parse_args()
    if args.steps < args.active + 2:
        raise SystemExit(f"--steps {args.steps}: at least --active + 2 ({args.active + 2})")
    sys.argv = [sys.argv[0], "--device", args.device, "--steps", str(args.steps)]
    bench, _ = mfu.setup(mfu.parse_args())
    weights = mfu.initial_weights(bench)
    for name in args.modes.split(","):
        mode = mfu.Mode.parse(name)
        mfu.warm_up(bench, [mode], weights)
        sides = {}
        for side in ("optimus", "reference"):
            mfu.fresh(bench.device)
            prof = profiler(bench.device, args.steps, args.active)
            stepper = (optimus_profiled(bench, mode, prof) if side == "optimus"
                       else reference_profiled(bench, mode, weights, prof))
            sides[side] = summarise(f"{name} {side}", prof, stepper, args.active)
            if args.trace:
                args.trace.mkdir(parents=True, exist_ok=True)
                plain = args.trace / f"{name}-{side}.json"
                prof.export_chrome_trace(str(plain))
                with open(plain, "rb") as src, gzip.open(f"{plain}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                plain.unlink()
        ours, ref = sides["optimus"], sides["reference"]
        print(f"\n=== {name}: step {ours['wall_s'] * 1e3:.1f} / {ref['wall_s'] * 1e3:.1f} ms "
              f"(ratio {ref['wall_s'] / ours['wall_s']:.3f}); device busy "
              f"{ours['busy_s'] * 1e3:.1f} / {ref['busy_s'] * 1e3:.1f} ms")
        differences(ours, ref, "device", args.top)
        differences(ours, ref, "host", args.top)


if __name__ == "__main__":
    main()
