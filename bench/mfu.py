"""MFU: tokens/s, TFLOP/s and MFU of the Mula-1B shape on one device, against a plain loop.

Each mode is a point of eager/compiled x bf16/float8 x activation recompute none/op, run twice
in this one process: by Optimus (`optimus.train.train`, one rank, the job keys below) and by
the loop a plain-PyTorch user would write around the same model (`build_model`: the same code
and weights) on the same batches. The figure is the ratio of their tokens/s, and beside it
the achieved TFLOP/s and the MFU against the bf16 dense peak of the device
(optimus/runtime/peaks.py); float8 modes are measured against that bf16 peak too, as trainers
commonly report them, and against their bf16 twin as a speed-up. The targets, in
bench/mfu_report.py: a ratio >= 1.00 in compiled bf16 without recompute and >= 0.97 elsewhere,
on a GPU; MFU >= 52% in that mode on an H200; float8 >= 1.15x bf16, compiled (eager float8
pays its scaling kernels unfused); 0 synchronisations per unlogged step of the trainer.

Job keys per mode: training.mixed_precision bf16 (fp32 for the CPU's fp32 mode),
training.compile, training.float8 (off, or --float8-recipe), parallel.activation_checkpoint
none | op, and supervision.log_every --log-every (3): the loss is read on the host every third
step, so the timed window holds unlogged steps. A trainer that does not honour a key yet runs
that mode without it, and the ratio shows it.

Timing and synchronisations (bench/mfu_window.py): each side's steps are marked at their
starts (the trainer's through `RankFaults.step_start`, its step's first call); the first
--warmup steps are dropped, the last closes the window, the device is synchronised at the
window's two ends only, and the figure is the window's mean step. Inside the window, on CUDA,
torch's sync debug mode counts each side's synchronising calls per step: "synchronisations per
unlogged step", target 0 for Optimus; on a CPU "n/a (cpu)".

The reference: fp32 master weights under torch.autocast(bf16) (what the PyTorch docs teach;
no per-step cast of the parameters), torchao's convert_to_float8_training on the blocks'
linear layers, torch.utils.checkpoint with create_selective_checkpoint_contexts keeping the
matmul and attention outputs, torch.compile on each block and on the loss, gradient clipping
and fused AdamW; its loss is read on the host at the same logged steps.

    python bench/mfu.py [--device cuda|cpu] [--modes a,b] [--steps N] [--out FILE]

On a CPU (no --shape) it runs a small shape (dim 256, 4 layers, 4 x 256 tokens a step) in
eager fp32 and bf16 on one thread: a check that it runs, in well under 2 minutes on two
cores, not an MFU figure.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.mfu_reference import reference_step_times  # noqa: E402
from bench.mfu_report import (  # noqa: E402
    FLOAT8_TARGET,
    KEY_MODE,
    KEY_RATIO_TARGET,
    MFU_TARGETS,
    RATIO_TARGET,
    float8_speedups,
    print_mode,
    print_speedups,
)
from bench.mfu_window import UNLOGGED_SYNC_TARGET, StepWindow, optimus_step_starts  # noqa: E402
from optimus.config import validate_job  # noqa: E402
from optimus.metrics import logs_step  # noqa: E402
from optimus.models import flops_per_token, param_count  # noqa: E402
from optimus.runtime import device_name  # noqa: E402
from optimus.runtime.peaks import peak_flops  # noqa: E402

WARM_UP_STEPS = 6  # per precision, untimed, before the first timed run: see warm_up
LOG_EVERY = 3  # supervision.log_every: steps 1-3, then every third, and the last are logged
SMALL = {"vocab_size": 4096, "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
         "max_seq_len": 256}


@dataclass(frozen=True)
class Mode:
    compile: bool
    precision: str  # fp32 | bf16 | float8
    ac: str  # none | op

    @property
    def name(self) -> str:
        return f"{'compiled' if self.compile else 'eager'}-{self.precision}-{self.ac}"

    @staticmethod
    def parse(name: str) -> Mode:
        try:
            how, precision, ac = name.split("-")
        except ValueError:
            raise SystemExit(f"mode {name!r}: write it as eager|compiled-fp32|bf16|float8-"
                             "none|op, e.g. compiled-float8-op") from None
        if how not in ("eager", "compiled") or precision not in ("fp32", "bf16", "float8") \
                or ac not in ("none", "op"):
            raise SystemExit(f"mode {name!r}: eager|compiled, fp32|bf16|float8, none|op")
        return Mode(how == "compiled", precision, ac)


def gpu_modes() -> list[Mode]:
    """Every mode of issue 16, most telling first: a run cut short still has those."""
    return [Mode(c, p, ac) for c, ac, p in itertools.product(
        (True, False), ("none", "op"), ("bf16", "float8"))]


@dataclass
class Bench:
    """What every mode shares: the shape, the step counts, the device."""

    device: torch.device
    model: dict
    seq_len: int
    batch: int
    steps: int
    warmup: int
    recipe: str
    num_workers: int
    log_every: int = LOG_EVERY

    def job(self, mode: Mode, run_dir: str, steps: int | None = None) -> dict:
        return {
            "name": "bench-mfu", "run_dir": run_dir, "seed": 1234, "model": self.model,
            "optim": {"steps": steps or self.steps, "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 2},
            "data": {"source": "synthetic", "seq_len": self.seq_len, "batch_size": self.batch,
                     "microbatches": 1, "num_workers": self.num_workers},
            "parallel": {"device": self.device.type, "activation_checkpoint": mode.ac},
            "training": {"mixed_precision": "fp32" if mode.precision == "fp32" else "bf16",
                         "compile": mode.compile,
                         "float8": self.recipe if mode.precision == "float8" else "off"},
            "checkpoint": {"interval": 0},
            "supervision": {"log_every": self.log_every},
        }

    def window(self, steps: int | None = None, warmup: int | None = None) -> StepWindow:
        """The timed window of one run, with the job's logging cadence (both sides read the
        loss on the host at the same steps)."""
        steps = steps or self.steps
        return StepWindow(self.device, steps, self.warmup if warmup is None else warmup,
                          logged=lambda step: logs_step(step, self.log_every, steps))

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


# --- one side of a mode ----------------------------------------------------------------------

def fresh(device: torch.device) -> None:
    """Between runs: no compiled graph, cached block or peak counter carries over."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def optimus_side(bench: Bench, mode: Mode) -> dict:
    """Optimus's own steps: `train()` in this process as one rank, its window's figures."""
    from optimus.train import train

    fresh(bench.device)
    with tempfile.TemporaryDirectory(prefix="bench-mfu-") as tmp:
        job = validate_job(bench.job(mode, tmp), world=1)
        with bench.window() as window, optimus_step_starts(window.step_start):
            result = train(job, quiet=True)
    return {**window.figures(), "first_loss": result.losses[0],
            "max_memory_bytes": peak_memory(bench.device)}


def reference_side(bench: Bench, mode: Mode, weights: dict) -> dict:
    fresh(bench.device)
    job = validate_job(bench.job(mode, "unused"), world=1)
    with bench.window() as window:
        first_loss = reference_step_times(job, mode, bench.device, weights, bench.recipe,
                                          window)
    return {**window.figures(), "first_loss": first_loss,
            "max_memory_bytes": peak_memory(bench.device)}


# --- figures ---------------------------------------------------------------------------------

def side_figures(side: dict, tokens_per_step: int, flops: int, peak: float | None) -> dict:
    """tokens/s, TFLOP/s and MFU of one side, from its windows' mean step (every round's
    window is exact at both ends, so the mean of the pooled steps is too)."""
    step = statistics.fmean(side["step_times_s"])
    tokens_per_s = tokens_per_step / step
    achieved = flops * tokens_per_s
    return {**side, "step_s": step, "tokens_per_s": tokens_per_s,
            "tflops": achieved / 1e12, "mfu": achieved / peak if peak else None}


# --- the run ---------------------------------------------------------------------------------

def skip_reason(mode: Mode, device: torch.device) -> str | None:
    """Why `mode` cannot run here, or None."""
    if mode.precision != "float8":
        return None
    if device.type != "cuda":
        return f"float8 matmuls need a CUDA device of capability >= 8.9; this is {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return (f"float8 matmuls need capability >= 8.9; {torch.cuda.get_device_name(device)} "
                f"is {capability[0]}.{capability[1]}")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"torchao is not installed ({e})"
    return None


def commit() -> str:
    """The code measured: git's HEAD, or OPTIMUS_COMMIT where the copy has no .git."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("OPTIMUS_COMMIT", "unknown")


def initial_weights(bench: Bench) -> dict:
    """The model's initial weights, once, on the CPU: each reference loads them rather than
    drawing them again (drawing 1.1B values takes seconds; they are `build_model`'s values)."""
    from optimus.models import build_model

    cfg = validate_job(bench.job(Mode(False, "bf16", "none"), "unused"), world=1).model
    return build_model(cfg, seed=1234, device="cpu").state_dict()


def warm_up(bench: Bench, modes: list[Mode], weights: dict) -> None:
    """A few untimed eager steps in each precision before any run is timed.

    A process's first steps in a precision are slow for reasons of the process, not of the
    loop: on a CPU, the first five bf16 steps took ~2 s each against 0.14 s after; CUDA loads
    kernels on first use. Without this, whichever side of a mode runs first pays for it.
    """
    for precision in dict.fromkeys(m.precision for m in modes):
        mode = Mode(False, precision, "none")
        if skip_reason(mode, bench.device) is None:
            fresh(bench.device)
            job = validate_job(bench.job(mode, "unused", steps=WARM_UP_STEPS), world=1)
            with bench.window(WARM_UP_STEPS, warmup=0) as window:
                reference_step_times(job, mode, bench.device, weights, bench.recipe, window)
    fresh(bench.device)


def run_mode(bench: Bench, mode: Mode, weights: dict, order: int, rounds: int) -> dict:
    """Both sides, `rounds` times, the one going first alternating; step times pooled."""
    sides = {"optimus": lambda: optimus_side(bench, mode),
             "reference": lambda: reference_side(bench, mode, weights)}
    pooled: dict[str, dict] = {}
    for r in range(rounds):
        names = list(sides) if (order + r) % 2 == 0 else list(reversed(sides))
        for name in names:
            side = sides[name]()
            if name in pooled:
                side["step_times_s"] = pooled[name]["step_times_s"] + side["step_times_s"]
                side["max_memory_bytes"] = max(side["max_memory_bytes"] or 0,
                                               pooled[name]["max_memory_bytes"] or 0) or None
            pooled[name] = side
    return pooled


def header_shape(bench: Bench) -> dict:
    """The shape measured, as the JSON records it (bench/torchtitan_peer.py matches it)."""
    return {**bench.model, "seq_len": bench.seq_len, "batch_size": bench.batch}


def header(bench: Bench, name: str, cfg, flops: int, peak: float | None, args) -> dict:
    info = {"device": name, "device_type": bench.device.type, "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": commit(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average_start": os.getloadavg()[0],
            "shape": header_shape(bench),
            "params": param_count(cfg), "flops_per_token": flops,
            "peak_bf16_tflops": peak / 1e12 if peak else None, "steps": bench.steps,
            "warmup_steps_dropped": bench.warmup, "rounds": args.rounds,
            "timed_steps": bench.steps - bench.warmup - 1, "step_figure": "window mean",
            "log_every": bench.log_every, "unlogged_sync_target": UNLOGGED_SYNC_TARGET,
            "float8_recipe": bench.recipe, "ratio_target": RATIO_TARGET,
            "key_mode": KEY_MODE, "key_ratio_target": KEY_RATIO_TARGET,
            "key_mfu_targets": MFU_TARGETS, "float8_speedup_target": FLOAT8_TARGET,
            "modes": {}, "skipped": {}, "failed": {}}
    print(f"{name}, torch {info['torch']} (cuda {info['cuda']}), commit {info['commit'][:12]}; "
          f"model {info['params'] / 1e6:,.1f}M params, seq {bench.seq_len} x batch "
          f"{bench.batch} = {bench.tokens_per_step:,} tokens/step, {flops / 1e9:.2f} GFLOP/token;"
          f" {bench.steps} steps a run, first {bench.warmup} dropped, the last closes the window; "
          f"loss read every {bench.log_every}", flush=True)
    return info


def write(out: Path | None, info: dict) -> None:
    """After every mode: a run cut short (a time limit) keeps the modes it finished."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(info, indent=1) + "\n")


def main() -> None:
    args = parse_args()
    bench, modes = setup(args)
    cfg = validate_job(bench.job(modes[0], "unused"), world=1).model
    flops = flops_per_token(cfg, bench.seq_len)
    name = device_name(bench.device)
    peak = peak_flops(name, args.peak_tflops, "bf16")
    info = header(bench, name, cfg, flops, peak, args)
    weights = initial_weights(bench)
    warm_up(bench, modes, weights)
    for i, mode in enumerate(modes):
        reason = skip_reason(mode, bench.device)
        if reason:
            print(f"{mode.name}: skipped: {reason}", flush=True)
            info["skipped"][mode.name] = reason
            continue
        started = time.perf_counter()
        try:
            sides = run_mode(bench, mode, weights, i, args.rounds)
        except Exception as e:  # one mode's failure (out of memory, say) leaves the others
            print(f"{mode.name}: FAILED: {type(e).__name__}: {e}", flush=True)
            info["failed"][mode.name] = f"{type(e).__name__}: {e}"
            fresh(bench.device)
            write(args.out, info)
            continue
        entry = {side: side_figures(v, bench.tokens_per_step, flops, peak)
                 for side, v in sides.items()}
        entry["ratio"] = entry["optimus"]["tokens_per_s"] / entry["reference"]["tokens_per_s"]
        entry["mode"] = asdict(mode)
        entry["wall_s"] = time.perf_counter() - started
        info["modes"][mode.name] = entry
        print_mode(mode.name, entry, name, bench.device.type == "cuda", peak)
        info["float8_speedup"] = float8_speedups(info["modes"])
        write(args.out, info)
    print_speedups(info.get("float8_speedup", {}))
    info["load_average_end"] = os.getloadavg()[0]
    print(f"load average {info['load_average_start']:.1f} at the start, "
          f"{info['load_average_end']:.1f} at the end ({os.cpu_count()} CPUs)")
    write(args.out, info)


def setup(args) -> tuple[Bench, list[Mode]]:
    on_gpu = args.device == "cuda"
    threads = args.threads or (None if on_gpu else 1)
    if threads:
        torch.set_num_threads(threads)
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    shape = args.shape or ("mula-1b" if on_gpu else "small")
    if shape == "mula-1b":
        model = yaml.safe_load((REPO / "jobs" / "mula-1b.yaml").read_text())["model"]
        seq, batch = 2048, 4
    else:
        model, seq, batch = SMALL, 256, 4
    warmup = (3 if on_gpu else 2) if args.warmup is None else args.warmup
    bench = Bench(device=torch.device(args.device), model=model, seq_len=args.seq or seq,
                  batch=args.batch or batch, steps=args.steps or (12 if on_gpu else 8),
                  warmup=warmup, recipe=args.float8_recipe,
                  num_workers=2 if on_gpu else 0,  # mula-1b.yaml reads with 2 workers
                  log_every=args.log_every)
    if args.modes:
        modes = [Mode.parse(m) for m in args.modes.split(",")]
    else:
        modes = gpu_modes() if on_gpu else [Mode(False, "fp32", "none"),
                                            Mode(False, "bf16", "none")]
    if bench.steps - bench.warmup < 2:
        raise SystemExit(f"--steps {bench.steps} leaves nothing to time after {bench.warmup} "
                         "warm-up (the last step closes the window)")
    return bench, modes


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", help="comma-separated, e.g. compiled-bf16-none,"
                        "compiled-float8-op (default: all eight on cuda; eager fp32 and bf16 "
                        "on cpu)")
    parser.add_argument("--shape", choices=["small", "mula-1b"],
                        help="default: mula-1b on cuda, small on cpu")
    parser.add_argument("--steps", type=int, help="steps per run (default 12 cuda, 8 cpu)")
    parser.add_argument("--warmup", type=int, help="first steps of each run dropped: "
                        "compilation, allocator (default 3 cuda, 2 cpu)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=LOG_EVERY,
                        help="supervision.log_every; the plain loop reads its loss as often")
    parser.add_argument("--batch", type=int, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, help="sequence length (default 2048 mula-1b)")
    parser.add_argument("--float8-recipe", choices=["tensorwise", "rowwise"],
                        default="tensorwise")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default 1 on cpu: "
                        "on a shared machine, a thread stalled by another process stalls every "
                        "step; torch's own on cuda)")
    parser.add_argument("--peak-tflops", type=float, help="override the peak table")
    parser.add_argument("--out", type=Path, help="JSON of every figure")
    return parser.parse_args()


if __name__ == "__main__":
    main()
