"""MFU: tokens/s, TFLOP/s and MFU of the Mula-1B shape on one device, against a plain loop.

Each mode is a point of eager/compiled x bf16/float8 x activation recompute none/op, run twice
in this one process: by Optimus (`optimus.train.train`, one rank, the job keys below) and by
the loop a plain-PyTorch user would write around the same model (`build_model`: the same code
and weights) on the same batches. The figure is the ratio of their tokens/s (target >= 0.97 on
a GPU), and beside it the achieved TFLOP/s and the MFU against the bf16 dense peak of the
device (optimus/runtime/peaks.py); float8 modes are measured against that bf16 peak too, as
trainers commonly report them, and against their bf16 twin as a speed-up (target >= 1.25 on
an H100, for compiled modes: eager float8 pays its scaling kernels unfused).

Job keys per mode: training.mixed_precision bf16 (fp32 for the CPU's fp32 mode),
training.compile, training.float8 (off, or --float8-recipe), parallel.activation_checkpoint
none | op. A trainer that does not honour a key yet runs that mode without it, and the ratio
shows it.

The reference: fp32 master weights under torch.autocast(bf16) (what the PyTorch docs teach;
no per-step cast of the parameters), torchao's convert_to_float8_training on the blocks'
linear layers, torch.utils.checkpoint with create_selective_checkpoint_contexts keeping the
matmul and attention outputs, torch.compile on each block and on the loss, gradient clipping
and fused AdamW.

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
from optimus.config import validate_job  # noqa: E402
from optimus.models import flops_per_token, param_count  # noqa: E402
from optimus.runtime import device_name  # noqa: E402
from optimus.runtime.peaks import peak_flops  # noqa: E402

RATIO_TARGET = 0.97  # Optimus / reference tokens/s, on a GPU
FLOAT8_TARGET = 1.25  # float8 / bf16 tokens/s, compiled, on an H100
WARM_UP_STEPS = 6  # per precision, untimed, before the first timed run: see warm_up
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
        }

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
    """Optimus's own step times: `train()` in this process as one rank, warm-up dropped."""
    from optimus.train import train

    fresh(bench.device)
    with tempfile.TemporaryDirectory(prefix="bench-mfu-") as tmp:
        job = validate_job(bench.job(mode, tmp), world=1)
        result = train(job, quiet=True)
    times = [m.step_time_s for m in result.metrics][bench.warmup:]
    return {"step_times_s": times, "first_loss": result.losses[0],
            "max_memory_bytes": peak_memory(bench.device)}


def reference_side(bench: Bench, mode: Mode, weights: dict) -> dict:
    fresh(bench.device)
    job = validate_job(bench.job(mode, "unused"), world=1)
    times, first_loss = reference_step_times(job, mode, bench.device, weights, bench.recipe)
    return {"step_times_s": times[bench.warmup:], "first_loss": first_loss,
            "max_memory_bytes": peak_memory(bench.device)}


# --- figures ---------------------------------------------------------------------------------

def side_figures(side: dict, bench: Bench, flops: int, peak: float | None) -> dict:
    median = statistics.median(side["step_times_s"])
    tokens_per_s = bench.tokens_per_step / median
    achieved = flops * tokens_per_s
    return {**side, "median_step_s": median, "tokens_per_s": tokens_per_s,
            "tflops": achieved / 1e12, "mfu": achieved / peak if peak else None}


def float8_speedups(entries: dict[str, dict]) -> dict[str, dict]:
    """float8 / bf16 tokens/s of each float8 mode against its bf16 twin, both sides."""
    out = {}
    for name, entry in entries.items():
        twin = entries.get(name.replace("-float8-", "-bf16-"))
        if "-float8-" in name and twin:
            out[name] = {side: entry[side]["tokens_per_s"] / twin[side]["tokens_per_s"]
                         for side in ("optimus", "reference")}
    return out


def flop_rate(tflops: float) -> str:
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.1f} GFLOP/s"


def gib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


def print_mode(name: str, entry: dict, on_gpu: bool, peak: float | None) -> None:
    ours, ref = entry["optimus"], entry["reference"]
    ratio = entry["ratio"]
    judged = (f"target >= {RATIO_TARGET}: {'met' if ratio >= RATIO_TARGET else 'MISSED'}"
              if on_gpu else "on a CPU recorded, not judged")
    print(f"{name}: optimus {ours['tokens_per_s']:,.0f} tok/s, reference "
          f"{ref['tokens_per_s']:,.0f} tok/s, ratio {ratio:.3f} ({judged})")
    against = " against the bf16 peak" if "float8" in name else ""
    mfu = (f"MFU {ours['mfu']:.1%} (reference {ref['mfu']:.1%}){against}, peak "
           f"{peak / 1e12:.0f} TFLOP/s" if peak else "MFU n/a (no peak for this device; "
           "--peak-tflops sets one)")
    print(f"    {flop_rate(ours['tflops'])} (reference {flop_rate(ref['tflops'])}); {mfu}; "
          f"memory optimus {gib(ours['max_memory_bytes'])}, reference "
          f"{gib(ref['max_memory_bytes'])}; first loss {ours['first_loss']:.4f} / "
          f"{ref['first_loss']:.4f}", flush=True)


def print_speedups(speedups: dict[str, dict]) -> None:
    for name, s in speedups.items():
        target = (f"target >= {FLOAT8_TARGET} on an H100" if name.startswith("compiled")
                  else "eager: no target, its scaling runs unfused")
        print(f"float8 speed-up {name}: optimus {s['optimus']:.2f}x, reference "
              f"{s['reference']:.2f}x over bf16 ({target})")


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
            reference_step_times(job, mode, bench.device, weights, bench.recipe)
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


def header(bench: Bench, name: str, cfg, flops: int, peak: float | None, args) -> dict:
    info = {"device": name, "device_type": bench.device.type, "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": commit(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average_start": os.getloadavg()[0],
            "shape": {**bench.model, "seq_len": bench.seq_len, "batch_size": bench.batch},
            "params": param_count(cfg), "flops_per_token": flops,
            "peak_bf16_tflops": peak / 1e12 if peak else None, "steps": bench.steps,
            "warmup_steps_dropped": bench.warmup, "rounds": args.rounds,
            "float8_recipe": bench.recipe, "ratio_target": RATIO_TARGET,
            "float8_speedup_target": FLOAT8_TARGET, "modes": {}, "skipped": {}, "failed": {}}
    print(f"{name}, torch {info['torch']} (cuda {info['cuda']}), commit {info['commit'][:12]}; "
          f"model {info['params'] / 1e6:,.1f}M params, seq {bench.seq_len} x batch "
          f"{bench.batch} = {bench.tokens_per_step:,} tokens/step, {flops / 1e9:.2f} GFLOP/token;"
          f" {bench.steps} steps a run, first {bench.warmup} dropped", flush=True)
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
        entry = {side: side_figures(v, bench, flops, peak) for side, v in sides.items()}
        entry["ratio"] = entry["optimus"]["tokens_per_s"] / entry["reference"]["tokens_per_s"]
        entry["mode"] = asdict(mode)
        entry["wall_s"] = time.perf_counter() - started
        info["modes"][mode.name] = entry
        print_mode(mode.name, entry, bench.device.type == "cuda", peak)
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
                  num_workers=2 if on_gpu else 0)  # mula-1b.yaml reads with 2 workers
    if args.modes:
        modes = [Mode.parse(m) for m in args.modes.split(",")]
    else:
        modes = gpu_modes() if on_gpu else [Mode(False, "fp32", "none"),
                                            Mode(False, "bf16", "none")]
    if bench.steps <= bench.warmup:
        raise SystemExit(f"--steps {bench.steps} leaves nothing after {bench.warmup} warm-up")
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
