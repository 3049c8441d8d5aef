"""What context parallelism (`parallel.cp`) needs of a job: pure Python, checked before any
process starts, one line a problem naming the key to change and a value that works."""

from __future__ import annotations


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_problems(job) -> list[tuple[str, str, str]]:
    """What cannot work in `job`'s context-parallel layout (cp > 1)."""
    m, p, seq = job.model, job.parallel, job.data.seq_len
    cp, tp, out = p.cp, p.tp, []
    chunks = 2 * cp if p.cp_split == "balanced" else cp
    per_rank = chunks // cp  # runs of positions each rank holds
    if seq % chunks:
        fits = [c for c in range(2, 65) if not seq % (per_rank * c)][:6]
        how = "2 x cp chunks, a head and a tail one a rank" if per_rank == 2 else "cp runs"
        out.append(("data.seq_len", f"{seq} does not split into {how} (cp={cp}: {chunks})",
                    f"use a multiple of {chunks}" + (f", or cp among {fits}" if fits else "")))
    elif (seq // cp) % tp:
        out.append(("data.seq_len", f"each rank's slice of {seq // cp} positions (seq_len / "
                    f"cp) does not split over tp={tp} (sequence parallel)",
                    f"use a multiple of {chunks * tp}"))
    heads = m.n_heads // tp if m.n_heads % tp == 0 else None
    if p.cp_method == "alltoall" and heads is not None and heads % cp:
        out.append(("parallel.cp", f"all-to-all attention gives each rank n_heads / (tp x cp) "
                    f"query heads, and {heads} (n_heads / tp) do not split over cp={cp}",
                    f"use cp among {_divisors(heads)}, or parallel.cp_method: ring"))
    if p.ep > 1 and p.ep % cp:
        out.append(("parallel.ep", f"ep={p.ep} is not a multiple of cp={cp}: experts borrow "
                    "whole context-parallel groups", f"use ep: {cp} (or a multiple), or ep: 1"))
    return out
