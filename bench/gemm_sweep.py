"""Matmul and attention rates of this device by shape: the table a machine profile loads.

Matmuls: `x @ w.t()` of x [m, k] and w [n, k] (a linear layer's forward; the planner looks its
input and weight gradients up as the matmuls they are) on a full grid of m, n, k: powers of
two from 128 to 32,768 on a GPU, which spans a 1B model's layers to a 405B's under tensor
parallel 1 to 8 (widths 2048 to 53,248 split 1 to 8 ways, 1,024 to 32,768 tokens a rank's
microbatch); beyond the grid the planner takes its edge, where large matmuls have reached their
plateau. In bf16, and in float8 (e4m3, tensorwise scales, `torch._scaled_mm`, bf16 out) where
the device has it; skipped, and said so, where not. Attention: causal
`scaled_dot_product_attention`, forward and backward, at the sequence lengths and head
dimensions of the job files (jobs/*.yaml) and 8,192, the rate counting the whole square as the
planner does.

Each shape is run once to warm up, then timed over as many runs as fit in `--each-ms` (at least
one), on CUDA with events around the runs. The output (`--out`, JSON) is
optimus/planner/rates.py's format, with the device, torch version and date; a machine profile
points at it with `rates:` (docs/planner.md). On a CPU (`--device cpu`) the same path runs on
a small grid in fp32 and bf16 in a few seconds (CI's check of the code path): a CPU's rates
are never a GPU profile's.

    python bench/gemm_sweep.py --device cuda --out h100-ndr.rates.json
    python bench/gemm_sweep.py --device cpu --out /tmp/cpu.rates.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from optimus.planner.rates import FORMAT, load_rates  # noqa: E402
from optimus.runtime.peaks import peak_flops  # noqa: E402

GPU_SIZES = tuple(2**i for i in range(7, 16))  # 128 .. 32,768
CPU_SIZES = (16, 64)
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Clock:
    """Seconds of `fn` per call: one warm-up, then as many calls as fit in `each` seconds."""

    def __init__(self, device: torch.device, each: float):
        self.device, self.each = device, each

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn) -> float:
        fn()
        self._sync()
        started = time.perf_counter()
        fn()
        self._sync()
        once = max(time.perf_counter() - started, 1e-7)
        runs = max(1, min(50, int(self.each / once)))
        if self.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(runs):
                fn()
            end.record()
            torch.cuda.synchronize()
            return begin.elapsed_time(end) / 1e3 / runs
        started = time.perf_counter()
        for _ in range(runs):
            fn()
        return (time.perf_counter() - started) / runs


def _sig(tflops: float) -> float:
    """Five significant figures (a CPU's rates are thousandths of a TFLOP/s)."""
    return float(f"{tflops:.5g}")


def float8_problem(device: torch.device) -> str | None:
    """Why float8 matmuls cannot be measured here, or None."""
    if device.type != "cuda":
        return "float8 is measured on a GPU only"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch._scaled_mm or float8_e4m3fn"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "float8 matmuls need compute capability 8.9 or newer"
    try:
        _scaled(torch.ones(16, 16, device=device), torch.ones(16, 16, device=device))()
    except (RuntimeError, TypeError) as e:
        return f"torch._scaled_mm refused a 16 x 16 matmul: {str(e).splitlines()[0][:120]}"
    return None


def _scaled(x: torch.Tensor, w: torch.Tensor):
    """A call of x @ w.t() in float8 with tensorwise scales, output bf16."""
    a = x.to(torch.float8_e4m3fn)
    b = w.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants its second operand
    one = torch.ones((), device=x.device, dtype=torch.float32)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def matmul_rows(device, dtype: str, sizes, clock: Clock) -> list[list]:
    """[m, n, k, TFLOP/s] for every m, n, k in `sizes`."""
    top = max(sizes)
    make = (lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)) if dtype == \
        "float8" else (lambda *s: torch.randn(*s, device=device, dtype=DTYPE[dtype]))
    x_all, w_all = make(top, top), make(top, top)
    rows = []
    for m in sizes:
        for n in sizes:
            for k in sizes:
                x, w = x_all[:m, :k].contiguous(), w_all[:n, :k].contiguous()
                fn = _scaled(x, w) if dtype == "float8" else (lambda x=x, w=w: F.linear(x, w))
                seconds = clock(fn)
                rows.append([m, n, k, _sig(2 * m * n * k / seconds / 1e12)])
    return rows


def attention_rows(device, dtype: str, shapes, clock: Clock, tokens: int) -> list[list]:
    """[seq_len, head_dim, TFLOP/s] of causal attention forward and backward; the FLOPs
    counted over the whole square, 12 x head_dim x seq_len per token and head."""
    rows = []
    for seq, head_dim in shapes:
        heads = max(1, tokens // seq)
        q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=DTYPE[dtype],
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)

        def step(q=q, k=k, v=v, grad=grad):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)

        seconds = clock(step)
        flops = 12 * head_dim * seq * seq * heads
        rows.append([seq, head_dim, _sig(flops / seconds / 1e12)])
    return rows


def job_attention_shapes(extra: tuple[int, ...] = (8192,), most: int = 131072) -> list:
    """(seq_len, head_dim) of every job file, and `extra` lengths at each head dim."""
    shapes = set()
    for path in sorted((REPO / "jobs").glob("*.yaml")):
        job = yaml.safe_load(path.read_text()) or {}
        model, data = job.get("model") or {}, job.get("data") or {}
        if "dim" in model and "n_heads" in model and "seq_len" in data:
            shapes.add((min(int(data["seq_len"]), most), model["dim"] // model["n_heads"]))
    dims = {d for _, d in shapes}
    shapes |= {(s, d) for s in extra for d in dims}
    # a full line per head dim: every length at every head dim
    return sorted({(s, d) for s in {s for s, _ in shapes} for d in dims})


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, required=True, help="the JSON table to write")
    p.add_argument("--dtypes", help="matmul dtypes (default: bf16,float8 on a GPU, fp32,bf16 "
                   "on a CPU)")
    p.add_argument("--each-ms", type=float, help="time spent per shape (default 20 on a GPU, "
                   "2 on a CPU)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    gpu = device.type == "cuda"
    clock = Clock(device, (args.each_ms or (20 if gpu else 2)) / 1e3)
    sizes = GPU_SIZES if gpu else CPU_SIZES
    wanted = (args.dtypes or ("bf16,float8" if gpu else "fp32,bf16")).split(",")
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    started = time.perf_counter()
    matmul, attention, notes = {}, {}, []
    for dtype in wanted:
        problem = float8_problem(device) if dtype == "float8" else None
        if problem:
            notes.append(f"float8 left out: {problem}")
            print(f"gemm_sweep: float8 left out: {problem}", flush=True)
            continue
        matmul[dtype] = matmul_rows(device, dtype, sizes, clock)
        best = max(r[3] for r in matmul[dtype])
        print(f"gemm_sweep: {dtype}: {len(matmul[dtype])} shapes, best {best:,.4g} TFLOP/s "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
    shapes = job_attention_shapes() if gpu else [(64, 16), (128, 16)]
    dtype = "bf16" if gpu else "fp32"
    attention[dtype] = attention_rows(device, dtype, shapes, clock, 32768 if gpu else 256)
    print(f"gemm_sweep: attention {dtype}: " + ", ".join(
        f"{s}x{d} {r:,.4g}" for s, d, r in attention[dtype]) + " TFLOP/s", flush=True)
    table = {"format": FORMAT, "device": name, "torch": torch.__version__,
             "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
             "matmul": matmul, "attention": attention}
    peak = peak_flops(name) if gpu else None
    if peak:
        table["peak_tflops"] = peak / 1e12
    if notes:
        table["note"] = "; ".join(notes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, separators=(",", ":")) + "\n")
    load_rates(args.out)  # what was written is what a profile can load
    print(f"gemm_sweep: wrote {args.out} ({args.out.stat().st_size:,} bytes) in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return args.out


if __name__ == "__main__":
    main()
