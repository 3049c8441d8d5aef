"""Trainer overhead: Optimus's step time on one CPU rank against a plain PyTorch loop.

Both run the same model (same code, same weights), the same batch shape and the same AdamW,
in this one process, in alternating rounds so that drift in the machine's speed hits both.
The figure is the ratio of median step times, Optimus / plain; the target is <= 1.03.

    .venv/bin/python bench/overhead.py [--rounds 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from optimus.config import validate_job
from optimus.data import SyntheticCorpus, build_loader, build_source
from optimus.data.prepare import prepare
from optimus.models import build_model
from optimus.train import train

WARMUP = 5  # steps dropped from each run: allocator and kernel warm-up


def bench_job(steps: int, shards: str) -> dict:
    return {
        "name": "bench-overhead",
        "model": {"vocab_size": 257, "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
                  "max_seq_len": 256},
        "optim": {"steps": steps, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
        "data": {"source": "shards", "path": shards, "seq_len": 256, "batch_size": 8,
                 "microbatches": 2},
        "parallel": {"device": "cpu"},
    }


def make_shards(out: Path) -> str:
    """Token shards as training reads them (memmap), from 2M characters of synthetic text."""
    corpus = SyntheticCorpus(vocab_size=257, seed=0)
    ids = corpus.read(0, 2_000_000)
    text = bytes(int(i) for i in ids if i != corpus.eos_id).decode()
    (out / "corpus.txt").write_text(text)
    prepare([out / "corpus.txt"], out / "shards", tokenizer="byte")
    return str(out / "shards")


def optimus_step_times(job) -> list[float]:
    result = train(job, quiet=True)
    return [m.step_time_s for m in result.metrics][WARMUP:]


def plain_step_times(job) -> list[float]:
    """The reference: the loop one would write by hand with the same model and optimizer.

    It trains on the very batches Optimus reads, taken from the loader before the clock
    starts, so the two differ only in what the trainer itself does per step.
    """
    cfg, d = job.model, job.data
    model = build_model(cfg, seed=job.seed, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.optim.lr,
                                  betas=(job.optim.beta1, job.optim.beta2),
                                  weight_decay=job.optim.weight_decay, fused=True)
    loader = iter(build_loader(build_source("shards", path=d.path, vocab_size=cfg.vocab_size),
                               seq_len=d.seq_len, batch_size=d.batch_size,
                               microbatches=d.microbatches, dp_rank=0, dp_size=1,
                               seed=job.seed))
    batches = [[next(loader) for _ in range(d.microbatches)] for _ in range(job.optim.steps)]
    times = []
    for step in range(job.optim.steps):
        started = time.perf_counter()
        for mb in batches[step]:
            logits = model(mb["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten())
            (loss / d.microbatches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - started)
    return times[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="optimus-bench-")
    job = validate_job(bench_job(args.steps, make_shards(Path(tmp.name))), world=1)
    runners = {"optimus": optimus_step_times, "plain": plain_step_times}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            times[name].extend(runners[name](job))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{name} {statistics.median(t) * 1e3:.1f} ms" for name, t in times.items()),
            flush=True)
    ours, plain = times["optimus"], times["plain"]
    m_ours, m_plain = statistics.median(ours), statistics.median(plain)
    tokens = job.data.batch_size * job.data.seq_len
    print(f"model {sum(p.numel() for p in build_model(job.model, 0, 'cpu').parameters()):,} "
          f"params, {tokens} tokens/step, torch threads {torch.get_num_threads()}")
    print(f"optimus step  median {m_ours * 1e3:.1f} ms  ({tokens / m_ours:,.0f} tok/s)")
    print(f"plain loop    median {m_plain * 1e3:.1f} ms  ({tokens / m_plain:,.0f} tok/s)")
    print(f"ratio optimus/plain = {m_ours / m_plain:.3f}  (target <= 1.03)")


if __name__ == "__main__":
    main()
