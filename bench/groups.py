"""What a generation's process groups cost to make, against keeping them (issue 30).

An in-process restart destroys every process group and makes them again: torch offers no
public way to keep a subgroup once the world group that holds a replaced rank is destroyed
(docs/control-plane.md, "In-process restart"). This measures what that costs, with W ranks as
real processes on this host (forks of this one, past their imports, as a warm start's are),
on the project's own path:

    world    the store's rendezvous and the default group (optimus.runtime.dist.init_distributed)
    groups   the layout's groups (ParallelDims.build_mesh: its dimensions of more than one
             rank, and pp, edp and tp), counted: the figure per group is groups / count
    kept     one collective on each of those groups once they exist: what a kept group costs
             the next generation instead
    destroy  destroy_distributed

for two generations in the same processes: the first is a new process's, the second an
in-process restart's (new port, the old groups destroyed). Each figure is the slowest rank's:
the generation waits for it. The ratio made / kept is (world + groups) / kept.

    .venv/bin/python bench/groups.py [--worlds 2,4,8] [--trials 3] [--json FILE]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from optimus.runtime.dims import ParallelDims  # noqa: E402
from optimus.runtime.dist import destroy_distributed, init_distributed  # noqa: E402
from optimus.runtime.launch import launch_env  # noqa: E402
from optimus.supervision.ports import unclaimed_port  # noqa: E402

GENERATIONS = 2
# One purpose per dimension the mesh may hold (LayoutMesh.build): the groups of those it does.
PURPOSES = ("pipeline", "shard", "experts", "context", "replicas", "tensor")
PARTS = ("world", "groups", "kept", "destroy")


def layout(world: int) -> ParallelDims:
    """The layout measured at `world` ranks: pp, then tp, then dp take the factors of two."""
    pp = 2 if world >= 8 else 1
    tp = 2 if world >= 4 else 1
    return ParallelDims(dp=world // (pp * tp), tp=tp, pp=pp)


def _groups_made() -> int:
    # torch keeps no public count of the groups a process holds; its registry's size is it.
    return len(dist.distributed_c10d._world.pg_map)


def _rank(rank: int, world: int, ports: list[int], out) -> None:
    torch.set_num_threads(1)
    dims, cpu = layout(world), torch.device("cpu")
    rows = []
    for generation, port in enumerate(ports):
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port), "OPTIMUS_RESTART_COUNT": str(generation)})
        started = time.perf_counter()
        init_distributed(launch_env(), "gloo", cpu, timeout_s=120)
        dist.barrier()  # every rank's group exists: what follows is the layout's alone
        world_s = time.perf_counter() - started
        before = _groups_made()
        started = time.perf_counter()
        mesh = dims.build_mesh("cpu")
        groups = [mesh.group(purpose) for purpose in PURPOSES if mesh.size(purpose) > 1]
        groups_s = time.perf_counter() - started
        count = _groups_made() - before
        started = time.perf_counter()
        for group in groups:
            dist.all_reduce(torch.ones(1), group=group)
        kept_s = time.perf_counter() - started
        del mesh, groups
        started = time.perf_counter()
        destroy_distributed()
        rows.append({"generation": generation, "world": world_s, "groups": groups_s,
                     "kept": kept_s, "destroy": time.perf_counter() - started,
                     "count": count})
    out.put((rank, rows))


def measure(world: int) -> list[dict]:
    """One trial at `world` ranks: per generation, each part's slowest rank."""
    ports = [unclaimed_port() for _ in range(GENERATIONS)]
    # Forks, past their imports, as a warm start's ranks are; a process with other threads
    # (one a test left, say) starts them fresh instead: a fork copies no thread's locks safely.
    ctx = multiprocessing.get_context("fork" if threading.active_count() == 1 else "spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, ports, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"rank {procs.index(p)} of {world} exited with {p.exitcode}")
    return [{**{part: max(got[r][g][part] for r in got) for part in PARTS},
             "count": got[0][g]["count"]} for g in range(GENERATIONS)]


def summary(trials: list[list[dict]]) -> list[dict]:
    """Medians over trials, per generation; per group and the made / kept ratio."""
    rows = []
    for g in range(GENERATIONS):
        row = {part: statistics.median(t[g][part] for t in trials) for part in PARTS}
        row["count"] = trials[0][g]["count"]
        row["per_group"] = row["groups"] / max(row["count"], 1)
        row["ratio"] = (row["world"] + row["groups"]) / max(row["kept"], 1e-9)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8", help="rank counts, comma-separated")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the medians here")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds {args.worlds!r}: give rank counts, e.g. 2,4,8")
    if args.trials < 1 or any(w < 2 or w & (w - 1) for w in worlds):
        parser.error("--trials must be >= 1 and each of --worlds a power of two >= 2")
    print(f"gloo, {os.cpu_count()} CPU(s), ranks as forked processes on one host; "
          f"{args.trials} trial(s); seconds, the slowest rank's, median over trials")
    print("| ranks | layout | generation | world | groups (count, each) | kept: a collective "
          "on each | destroy | made / kept |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for world in worlds:
        dims = layout(world)
        rows = summary([measure(world) for _ in range(args.trials)])
        results[str(world)] = rows
        for g, row in enumerate(rows):
            print(f"| {world} | pp{dims.pp} dp{dims.dp} tp{dims.tp} | "
                  f"{'new process' if g == 0 else 'in process'} | {row['world']:.4f} | "
                  f"{row['groups']:.4f} ({row['count']}, {row['per_group']:.4f}) | "
                  f"{row['kept']:.4f} | {row['destroy']:.4f} | {row['ratio']:.0f}x |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
