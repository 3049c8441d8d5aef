"""Checkpoint cost on one rank: time the loop is blocked per save, write and load bandwidth.

One rank (world 1 on a HashStore: gloo on a CPU, NCCL with `--device cuda`, where weights and
optimizer state live in GPU memory and a save stages them from there), a GPT whose training
state (fp32 weights + AdamW exp_avg + exp_avg_sq: 12 bytes/param) is a few hundred MB, saved by
`Checkpointer` into a temp dir under runs/ (the repo's disk). Each figure is printed beside its
reference, measured in the same run in alternating rounds, as a ratio of medians:

1. Blocked share: real steps (forward, backward, AdamW) with the trainer's pieces, a save every
   INTERVAL steps, poll() at every step boundary. Blocked per save: the host's time inside
   save() plus its copy's fence at the next optimizer step (`last_blocked_s` after that step);
   its median / the median step time without a save (target <= 5%), for "process" (the
   default), "thread" and "sync"; beside it, the step time on save steps (and on steps with a
   write in flight) minus that median, which also holds what the device waited (on a GPU the
   next update waits for the copy there, not on the host).
2. Write bandwidth with the loop idle: bytes / background write time (from save() returning,
   staging done, to this rank's files written; save() to written is printed too), against
   one plain file of the same size written in CHUNK pieces then fsync'd (target >= 0.8x).
   DCP's FileSystemWriter fsyncs every file (sync_files=True), so the fsync'd write is the fair
   reference; the write without fsync (page cache only) is printed as the ceiling. The commit
   (hash every file, manifest, marker) is timed apart, and end to end.
3. Load bandwidth: `Checkpointer.load` with deep_verify on and off, against reading the same
   files; with the page cache dropped before each read where /proc/sys/vm/drop_caches is
   writable, and warm.

    .venv/bin/python bench/checkpoint.py [--layers 2] [--dim 1024] [--rounds 3] [--quick]
                                         [--device cpu|cuda] [--blocked-only]

About 8 minutes on two cores with the defaults (`--blocked-only`: part 1 alone, a third of
that); figures and findings in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from optimus.checkpoint.manifest import file_digests, read_manifest
from optimus.checkpoint.saver import Checkpointer
from optimus.checkpoint.state import Progress, layout_key, training_state
from optimus.config import job_hash, resolve_layout, validate_job
from optimus.data import build_loader, build_source
from optimus.optim import build_optimizer, lr_at, set_lr
from optimus.parallel.grads import clip_grad_norm_
from optimus.parallel.plan import IGNORE_INDEX, build_parallel_model
from optimus.runtime import destroy_distributed, init_distributed, launch_env, pick_backend

REPO = Path(__file__).resolve().parents[1]
MODES = ("process", "thread", "sync")
SEQ, BATCH = 256, 8  # 2,048 tokens a step: ~2 s for the default model on two quiet cores
INTERVAL = 4  # steps between saves: the write and commit finish before the next one is due
CHUNK = 32 << 20  # bytes per write()/readinto() of the plain-file references
REPEATS = 5  # writes and loads of each kind per round (each takes about a second)
BYTES_PER_PARAM = 12  # fp32 weight + AdamW exp_avg + exp_avg_sq


def bench_job(layers: int, dim: int, device: str = "cpu") -> dict:
    return {
        "name": "bench-checkpoint",
        "model": {"vocab_size": 257, "dim": dim, "n_layers": layers, "n_heads": dim // 64,
                  "max_seq_len": SEQ},
        "optim": {"steps": 100_000, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 10},
        "data": {"source": "synthetic", "seq_len": SEQ, "batch_size": BATCH, "microbatches": 1},
        "parallel": {"device": device},
    }


class Rank:
    """The trainer's pieces on one rank, and its training state as the trainer saves it."""

    def __init__(self, job):
        self.job = job
        self.device = device = torch.device(job.parallel.device)
        init_distributed(launch_env({}), pick_backend(device), device)  # world 1: a HashStore
        layout = resolve_layout(job, 1)
        self.mesh = mesh = layout.build_mesh(device.type)
        torch.manual_seed(job.seed)
        self.model = build_parallel_model(job, mesh, device)
        self.optimizer = build_optimizer(self.model.state_view(), job.optim, device)
        self.progress = Progress(job.data.batch_size)
        self.state = training_state(self.model, self.optimizer, self.progress, rank=0,
                                    layout=layout_key(layout, device))
        source = build_source("synthetic", vocab_size=job.model.vocab_size, seed=job.seed)
        self.batches = iter(build_loader(source, seq_len=SEQ, batch_size=BATCH,
                                         microbatches=job.data.microbatches, dp_rank=0,
                                         dp_size=1, seed=job.seed))
        self.meta = {"layout": asdict(layout), "config_hash": job_hash(job), "world_size": 1}
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self, before_update=None) -> None:
        """One optimizer step, as `optimus.train` runs it (`before_update`: what it calls
        before the optimizer's step, e.g. a snapshot's fence)."""
        step = self.progress.step + 1
        set_lr(self.optimizer, lr_at(step, self.job.optim))
        microbatches = [next(self.batches) for _ in range(self.job.data.microbatches)]
        tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in microbatches)
        self.model.loss_fn.tokens = tokens
        # bf16 on cuda: the model's mixed precision (training.mixed_precision).
        loss = self.model.forward_backward(microbatches, self.device)
        clip_grad_norm_(self.model.parameters(), self.job.optim.grad_clip,
                        self.mesh.size("pipeline"))
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.advance(tokens)
        loss.item()  # waits for the device, as the trainer's logged step does

    def save(self, ckpt: Checkpointer, step: int) -> str:
        return ckpt.save(step, self.state, {**self.progress.meta(), **self.meta})


# --- 1. blocked time per save ------------------------------------------------------------------

def in_flight(ckpt: Checkpointer) -> bool:
    s = ckpt.stats
    return s.saves_started > s.saves_committed + s.saves_failed


def training_run(rank: Rank, ckpt: Checkpointer, saves: int, out: dict) -> None:
    """Train INTERVAL * saves + 1 steps, saving every INTERVAL; file step times by kind, and
    each save's blocked time once the next step's update has fenced its copy."""
    saved = False
    for i in range(1, INTERVAL * saves + 2):
        busy = in_flight(ckpt)
        started = time.perf_counter()
        rank.step()  # its optimizer step fences the last save's copy (a step pre-hook)
        if saved:
            out["blocked"].append(ckpt.stats.last_blocked_s)
            out["fence"].append(ckpt.stats.last_blocked_s - out["in_save"][-1])
        ckpt.poll()  # the trainer's step boundary: `RunCheckpoints.after_step`
        due = saved = i % INTERVAL == 0 and i <= INTERVAL * saves
        if due:
            outcome = rank.save(ckpt, rank.progress.step)
            if outcome not in ("started", "committed"):
                out["not_started"].append(outcome)
            out["in_save"].append(ckpt.stats.last_blocked_s)
        elapsed = time.perf_counter() - started
        out["save" if due else "in_flight" if busy else "idle"].append(elapsed)
    ckpt.wait()


# --- 2. write bandwidth ------------------------------------------------------------------------

def checkpoint_bytes(path: Path) -> int:
    """What DCP wrote: every file the manifest lists (shards and .metadata)."""
    return sum(f["size"] for f in read_manifest(path)["files"].values())


def timed_save(rank: Rank, ckpt: Checkpointer, step: int) -> dict:
    """One save with the loop idle: save(), then wait() for the commit."""
    for old in ckpt.root.glob("step_*"):  # nothing for retention to delete inside the timing
        shutil.rmtree(old)
    os.sync()  # no dirty pages of an earlier write left to flush inside the timing
    started = time.perf_counter()
    outcome = rank.save(ckpt, step)
    ckpt.wait()
    end_to_end = time.perf_counter() - started
    if outcome not in ("started", "committed") or ckpt.stats.last_commit_step != step:
        raise RuntimeError(f"{ckpt.mode} save of step {step}: {outcome}, {ckpt.last_error}")
    path = ckpt.root / f"step_{step:09d}"
    hash_started = time.perf_counter()
    file_digests(path)  # the hashing part of the commit, alone (page cache warm)
    write, blocked = ckpt.stats.last_write_s, ckpt.stats.last_blocked_s
    # The background write: from save() returning (staging done) to this rank's files written.
    # A sync save has no background part: its whole write is in the foreground.
    background = write if ckpt.mode == "sync" else write - blocked
    return {"write": write, "blocked": blocked, "background": background,
            "end_to_end": end_to_end, "commit": end_to_end - ckpt.stats.last_write_s,
            "hash": time.perf_counter() - hash_started, "bytes": checkpoint_bytes(path),
            "path": path}


def write_file(path: Path, data: memoryview, fsync: bool) -> float:
    started = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, len(data), CHUNK):
            f.write(data[offset:offset + CHUNK])
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return time.perf_counter() - started


def plain_write(path: Path, data: memoryview, fsync: bool) -> float:
    """One timed write of `data`, in the conditions `timed_save` gives the checkpoint's.

    A save starts right after its predecessor (as many bytes) was deleted, so the page cache
    it fills takes pages freed a moment before; so does this write. It matters on a VM that
    hands idle free pages back to the host (virtio-balloon free page reporting): filling the
    page cache with pages that went back costs up to ~0.6 s per 300 MB, against ~0.05 s.
    """
    write_file(path, data, fsync=False)
    path.unlink()
    os.sync()
    elapsed = write_file(path, data, fsync)
    path.unlink()
    return elapsed


# --- 3. load bandwidth -------------------------------------------------------------------------

def drop_caches() -> bool:
    """Drop the page cache (clean pages only: sync first); False where this is not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def plain_read(path: Path) -> None:
    buf = bytearray(CHUNK)
    for file in files_of(path):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# --- report ------------------------------------------------------------------------------------

def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def filesystem(path: Path) -> str:
    """`type (device)` of the mount holding `path`, from /proc/mounts."""
    best = ("?", "?", "")
    with open("/proc/mounts") as f:
        for line in f:
            device, mount, kind = line.split()[:3]
            if path.is_relative_to(mount) and len(mount) >= len(best[2]):
                best = (kind, device, mount)
    return f"{best[0]} ({best[1]} on {best[2]})"


def mb_s(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:,.0f} MB/s"


def rotated(names: tuple[str, ...], r: int) -> list[str]:
    return list(names[r % len(names):] + names[:r % len(names)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="one round, two saves per run: a smoke test, not a figure")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model and optimizer state live (a save stages them "
                             "from there)")
    parser.add_argument("--blocked-only", action="store_true",
                        help="part 1 alone: the blocked time per save, no bandwidths")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    saves = 2 if args.quick else 3

    rank = Rank(validate_job(bench_job(args.layers, args.dim, args.device), world=1))
    (REPO / "runs").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=REPO / "runs"))
    try:
        run(rank, tmp, rounds, saves, args.blocked_only)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        destroy_distributed()


def run(rank: Rank, tmp: Path, rounds: int, saves: int, blocked_only: bool = False) -> None:
    state_bytes = rank.params * BYTES_PER_PARAM
    print(f"model {rank.params:,} params x {BYTES_PER_PARAM} B = {state_bytes:,} B of training "
          f"state (fp32 weights + AdamW exp_avg + exp_avg_sq); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    print(f"temp dir {tmp} on {filesystem(tmp)}; load average {os.getloadavg()[0]:.1f}")
    print(f"step: batch {BATCH} x {SEQ} tokens, 1 microbatch, fused AdamW; a save every "
          f"{INTERVAL} steps, {saves} per run, {rounds} round(s)", flush=True)
    rank.step()  # AdamW's state exists from the first step on
    ckpts = {m: Checkpointer(tmp / m, rank=0, world_size=1, keep_last=1, mode=m) for m in MODES}
    step = 10**6  # part 2's saves take steps the training runs never reach

    # First save of each mode, loop idle: "process" starts DCP's writer process here.
    for mode in MODES:
        step += 1
        first = timed_save(rank, ckpts[mode], step)
        print(f"first save, {mode}: blocked {first['blocked']:.3f} s, written after "
              f"{first['write']:.2f} s, committed after {first['end_to_end']:.2f} s "
              f"({ckpts[mode].mode_note or 'mode as asked'})", flush=True)
    files_bytes = first["bytes"]
    print(f"checkpoint files: {files_bytes:,} B ({files_bytes / state_bytes:.4f}x the state)")

    # 1. Blocked time per save, training.
    runs = {m: {"blocked": [], "in_save": [], "fence": [], "save": [], "in_flight": [],
                "idle": [], "not_started": []} for m in MODES}
    for r in range(rounds):
        for mode in rotated(MODES, r):
            training_run(rank, ckpts[mode], saves, runs[mode])
        print(f"round {r + 1}/{rounds}, training: " + ", ".join(
            f"{m} blocked {median(runs[m]['blocked']):.3f} s" for m in MODES)
            + f"; idle step {median([t for m in MODES for t in runs[m]['idle']]):.2f} s; "
            f"load average {os.getloadavg()[0]:.1f}", flush=True)

    if blocked_only:
        for ckpt in ckpts.values():
            ckpt.close()
        report_blocked(runs)
        return

    # 2. Write bandwidth, loop idle, against plain writes of as many bytes.
    data = memoryview(torch.randint(0, 256, (files_bytes,), dtype=torch.uint8).numpy())
    writes: dict[str, list[dict]] = {m: [] for m in MODES}
    plain: dict[str, list[float]] = {"fsync": [], "no fsync": []}
    kinds = (*MODES, "fsync", "no fsync")
    for r in range(rounds):
        for i in range(REPEATS):
            for kind in rotated(kinds, r * REPEATS + i):
                if kind in plain:
                    plain[kind].append(plain_write(tmp / "plain.bin", data, kind == "fsync"))
                else:
                    step += 1
                    writes[kind].append(timed_save(rank, ckpts[kind], step))
        print(f"round {r + 1}/{rounds}, writes: " + ", ".join(
            f"{m} {mb_s(files_bytes, median([w['write'] for w in writes[m]]))}" for m in MODES)
            + ", " + ", ".join(f"plain {k} {mb_s(files_bytes, median(t))}"
                               for k, t in plain.items()), flush=True)

    # 3. Load bandwidth, from the last checkpoint written by the default mode.
    path = writes["process"][-1]["path"]
    load_bytes = sum(f.stat().st_size for f in files_of(path))
    readers = {
        "load deep_verify": lambda: ckpts["process"].load(path, rank.state, deep_verify=True),
        "load sizes only": lambda: ckpts["process"].load(path, rank.state, deep_verify=False),
        "plain read": lambda: plain_read(path),
    }
    cold = drop_caches()
    caches = ("cold", "warm") if cold else ("warm",)
    loads = {(c, name): [] for c in caches for name in readers}
    for r in range(rounds):
        for i in range(REPEATS):
            for cache in caches:
                for name in rotated(tuple(readers), r * REPEATS + i):
                    if cache == "cold":
                        drop_caches()
                    else:
                        plain_read(path)  # every file in the page cache
                    started = time.perf_counter()
                    readers[name]()
                    loads[cache, name].append(time.perf_counter() - started)
        print(f"round {r + 1}/{rounds}, loads: " + ", ".join(
            f"{c} {n} {mb_s(load_bytes, median(t))}" for (c, n), t in loads.items()), flush=True)

    for ckpt in ckpts.values():
        ckpt.close()
    report(runs, writes, plain, loads, files_bytes, load_bytes, cold, rank)


def report(runs, writes, plain, loads, files_bytes, load_bytes, cold, rank) -> None:
    report_blocked(runs)
    report_io(writes, plain, loads, files_bytes, load_bytes, cold, rank)


TARGET = 0.05  # blocked per save / step time


def report_blocked(runs) -> None:
    idle = median([t for m in MODES for t in runs[m]["idle"]])
    print(f"\n1. blocked per save / step time (target <= {TARGET:.0%}); median step without a "
          f"save {idle:.3f} s ({BATCH * SEQ} tokens, {BATCH * SEQ / idle:,.0f} tok/s); blocked: "
          "the host's time in save() + at the next update's fence, medians")
    for m in MODES:
        r = runs[m]
        blocked = median(r["blocked"])
        met = "met" if blocked / idle <= TARGET else "MISSED"
        print(f"  {m:8s} blocked per save / step time {blocked:.4f} s / {idle:.3f} s = "
              f"{blocked / idle:.2%} (target <= {TARGET:.0%}: {met}); in save() "
              f"{median(r['in_save']):.4f} s, fence {median(r['fence']):.4f} s; max "
              f"{max(r['blocked']):.3f} s; {len(r['save'])} saves, not started: "
              f"{r['not_started'] or 'none'}")
        # The honesty check, and what a save costs the loop in all: the steps it slows too.
        slowed = sum(r["save"]) + sum(r["in_flight"]) - idle * (len(r["save"])
                                                                + len(r["in_flight"]))
        flight = (f"; {len(r['in_flight'])} steps with the write in flight: "
                  f"{median(r['in_flight']) - idle:+.3f} s each" if r["in_flight"] else "")
        print(f"           save step minus step without a save {median(r['save']) - idle:+.3f} s"
              f"{flight}; all slowed steps {slowed / len(r['save']):.3f} s per save = "
              f"{slowed / len(r['save']) / idle:.1%} of a step")


def report_io(writes, plain, loads, files_bytes, load_bytes, cold, rank) -> None:
    # Filling the page cache is noisy on this VM (see plain_write): medians, and the best
    # of each, whose ratio is what is left when that noise is taken out.
    fsync, no_fsync = median(plain["fsync"]), median(plain["no fsync"])
    best_fsync = min(plain["fsync"])
    print(f"\n2. write bandwidth, loop idle, {files_bytes:,} B (target >= 0.8x plain + fsync); "
          f"plain write + fsync {mb_s(files_bytes, fsync)} ({fsync:.3f} s; best "
          f"{best_fsync:.3f} s, worst {max(plain['fsync']):.3f} s; n={len(plain['fsync'])}), "
          f"without fsync {mb_s(files_bytes, no_fsync)} ({no_fsync:.3f} s)")
    for m in MODES:
        w = {k: median([x[k] for x in writes[m]]) for k in ("write", "commit", "end_to_end",
                                                           "hash", "blocked", "background")}
        best = min(x["background"] for x in writes[m])
        bg = w["background"]
        met = "met" if bg <= fsync / 0.8 else "MISSED"
        label = "write (foreground)" if m == "sync" else "background write"
        print(f"  {m:8s} {label} {bg:.3f} s = {mb_s(files_bytes, bg)} = {fsync / bg:.2f}x "
              f"plain + fsync ({met}), {no_fsync / bg:.2f}x without; best {best:.3f} s "
              f"against {best_fsync:.3f} s = {best_fsync / best:.2f}x; n={len(writes[m])}")
        print(f"           save() to written, staging included {w['write']:.3f} s = "
              f"{mb_s(files_bytes, w['write'])} = {fsync / w['write']:.2f}x plain + fsync")
        print(f"           commit {w['commit']:.3f} s (hashing alone {w['hash']:.3f} s = "
              f"{mb_s(files_bytes, w['hash'])}); save() to committed {w['end_to_end']:.3f} s = "
              f"{mb_s(files_bytes, w['end_to_end'])} = {fsync / w['end_to_end']:.2f}x plain + "
              f"fsync; blocked {w['blocked']:.3f} s")

    print(f"\n3. load bandwidth, {load_bytes:,} B (no target); page cache "
          f"{'dropped before each read, and warm' if cold else 'warm (cannot drop it here)'}")
    for cache in ("cold", "warm") if cold else ("warm",):
        base = median(loads[cache, "plain read"])
        for name in ("load deep_verify", "load sizes only", "plain read"):
            t = median(loads[cache, name])
            print(f"  {cache} {name:17s} {t:.2f} s = {mb_s(load_bytes, t)}, "
                  f"{base / t:.2f}x plain read")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}; params {rank.params:,}")


if __name__ == "__main__":
    main()
