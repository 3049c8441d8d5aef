"""Context parallel: activation memory, step time and bytes sent per rank, against one process.

    .venv/bin/python bench/context_parallel.py [--quick] [--seqs 256,512,1024,2048]
        [--dim 256] [--layers 4] [--heads 8] [--kv-heads 4] [--repeat 3] [--json FILE]

A small GPT (fp32, one microbatch of one sequence) on a 4-rank gloo world on this host, one
thread a rank (bench/context_parallel_rank.py says how each figure is taken). At each
sequence length the reference is one process running the whole sequence (cp 1, the model's
own causal SDPA); then `parallel.cp_method` alltoall and ring at cp 2 and cp 4, the balanced
split (`parallel.cp_split`'s default), each rank on its slice of the same tokens:

1. held: the activation memory of a rank, what autograd holds from the forward to the
   backward (the saved tensors' storages, each once; the parameters, the fixed part, apart),
   and its ratio to one process's. Target: 1/cp.
2. step: forward and backward, the slowest rank's, median of --repeat; its ratio to one
   process's. On this CPU, indicative only: the ranks share the host's cores (cp 4 runs four
   single-thread ranks on however many cores there are) and gloo is loopback TCP. No target.
3. sent: the bytes a rank sends other ranks per layer, forward and backward, counted at
   torch.distributed, against the formula from the shapes. Target: equal.

Every run's loss and gradients, summed over its group, are checked against one process's
(within 1e-5, relative): the bench exits 1 if one is not, or if a count is not its formula.
`--quick`: dim 128, 2 layers, sequences 256 and 1024, one timed repeat (the test's run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from queue import Empty

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.context_parallel_rank import CPS, METHODS, WORLD, Spec, run  # noqa: E402
from optimus.supervision.ports import unclaimed_port  # noqa: E402

TIMEOUT_S = 900
TOLERANCE = 1e-5  # loss and gradients against one process, relative (fp32)
KIB, MIB = 1024, 1024 * 1024


def ranks(spec: Spec) -> list[dict]:
    """Every rank's rows, from one 4-rank world."""
    # Forks, past their imports; a process with other threads starts them fresh instead.
    ctx = multiprocessing.get_context("fork" if threading.active_count() == 1 else "spawn")
    queue, port = ctx.Queue(), unclaimed_port()
    procs = [ctx.Process(target=run, args=(r, port, spec, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + TIMEOUT_S
    try:
        while len(got) < WORLD:
            try:
                got.append(queue.get(timeout=1))
            except Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise SystemExit(f"ranks {dead} failed" if dead else
                                     f"the ranks did not finish within {TIMEOUT_S} s") from None
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    return [r for rows in got for r in rows]


def figures(spec: Spec, rows: list[dict]) -> list[dict]:
    """One line per (seq, method, cp): held the largest rank's, the step the slowest rank's
    per repeat, sent the largest rank's per layer; ratios to the reference's."""
    out = []
    for seq in spec.seqs:
        (ref,) = [r for r in rows if r["seq"] == seq and r["kind"] == "reference"]
        ref_s = statistics.median(ref["seconds"])
        out.append({"seq": seq, "method": "one process", "cp": 1, "held": ref["held"],
                    "fixed": ref["fixed"], "held_ratio": 1.0, "step_s": ref_s,
                    "step_ratio": 1.0, "sent": {"forward": 0, "backward": 0},
                    "formula": {"forward": 0, "backward": 0},
                    "loss_error": 0.0, "grad_error": 0.0})
        for method in METHODS:
            for cp in CPS:
                mine = sorted((r for r in rows if (r["seq"], r["method"], r["cp"]) ==
                               (seq, method, cp)), key=lambda r: r["rank"])
                held = max(r["held"] for r in mine)
                slowest = zip(*(r["seconds"] for r in mine), strict=True)  # per repeat
                step = statistics.median([max(s) for s in slowest])
                sent = {phase: [r["sent"][phase] / spec.layers for r in mine]
                        for phase in ("forward", "backward")}
                out.append({"seq": seq, "method": method, "cp": cp, "held": held,
                            "fixed": mine[0]["fixed"], "held_ratio": held / ref["held"],
                            "step_s": step, "step_ratio": step / ref_s,
                            "sent": {phase: max(v) for phase, v in sent.items()},
                            "sent_ranks": sent, "formula": spec.sent_formula(method, cp, seq),
                            "loss_error": mine[0]["loss_error"],
                            "grad_error": mine[0]["grad_error"]})
    return out


def failures(lines: list[dict]) -> list[str]:
    bad = []
    for f in lines:
        name = f"seq {f['seq']} {f['method']} cp {f['cp']}"
        if not (f["loss_error"] <= TOLERANCE and f["grad_error"] <= TOLERANCE):
            bad.append(f"{name}: loss {f['loss_error']:.1e}, gradients {f['grad_error']:.1e} "
                       f"from one process's (tolerance {TOLERANCE:.0e})")
        for phase, sent in f.get("sent_ranks", {}).items():
            if any(s != f["formula"][phase] for s in sent):
                bad.append(f"{name}: {phase} sent {sent} bytes per layer by rank, the "
                           f"formula {f['formula'][phase]}")
    return bad


def print_table(spec: Spec, lines: list[dict]) -> None:
    print("| seq | method | cp | held MiB a rank | / one process (target 1/cp) | step ms | "
          "/ one process | sent KiB a layer, fwd + bwd (formula) | x the layer's input "
          "| loss, grad error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in lines:
        row = (f"| {f['seq']} | {f['method']} | {f['cp']} | {f['held'] / MIB:,.1f} | "
               f"{f['held_ratio']:.2f}")
        if f["cp"] == 1:
            print(f"{row} | {f['step_s'] * 1e3:,.0f} | 1.00 | - | - | - |")
            continue
        x = spec.batch * f["seq"] // f["cp"] * spec.dim * 4  # one layer's input on a rank
        sent, formula = f["sent"], f["formula"]
        print(f"{row} (1/{f['cp']} = {1 / f['cp']:.2f}) | {f['step_s'] * 1e3:,.0f} | "
              f"{f['step_ratio']:.2f} | {sent['forward'] / KIB:,.0f} + "
              f"{sent['backward'] / KIB:,.0f} ({formula['forward'] / KIB:,.0f} + "
              f"{formula['backward'] / KIB:,.0f}) | {sent['forward'] / x:.2f} + "
              f"{sent['backward'] / x:.2f} | {f['loss_error']:.0e}, {f['grad_error']:.0e} |")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="dim 128, 2 layers, sequences 256 "
                   "and 1024, one repeat")
    p.add_argument("--seqs", help="sequence lengths, comma-separated (default "
                   "256,512,1024,2048); each a multiple of 2 x 4")
    p.add_argument("--dim", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--repeat", type=int, help="timed forward and backward passes (default 3)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    quick = args.quick
    try:
        seqs = tuple(int(s) for s in (args.seqs or ("256,1024" if quick else
                                                    "256,512,1024,2048")).split(","))
    except ValueError:
        p.error(f"--seqs {args.seqs!r}: give lengths, e.g. 256,1024")
    if any(s % (2 * WORLD) for s in seqs) or args.heads % WORLD:
        p.error(f"each of --seqs must divide by {2 * WORLD} and --heads by {WORLD}")
    spec = Spec(seqs=seqs, dim=args.dim or (128 if quick else 256),
                layers=args.layers or (2 if quick else 4), heads=args.heads,
                kv_heads=args.kv_heads, vocab=512, batch=1,
                repeat=args.repeat or (1 if quick else 3))
    return spec, args.json


def main(argv: list[str] | None = None) -> int:
    spec, out = parse_args(argv)
    began = time.perf_counter()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s), {WORLD} gloo ranks of one "
          f"thread; GPT dim {spec.dim}, {spec.layers} layers, {spec.heads} heads "
          f"({spec.kv_heads} kv), vocab {spec.vocab}, fp32, {spec.batch} sequence; balanced "
          f"split; step times indicative only on a CPU", flush=True)
    lines = figures(spec, ranks(spec))
    print(f"parameters (the fixed part, on every rank): {lines[0]['fixed'] / MIB:,.1f} MiB")
    print_table(spec, lines)
    if out:
        out.write_text(json.dumps({"spec": spec.__dict__, "figures": lines}, indent=1) + "\n")
    bad = failures(lines)
    for line in bad:
        print(f"FAILED: {line}")
    print(f"{time.perf_counter() - began:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
