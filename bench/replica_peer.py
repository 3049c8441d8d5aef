"""torchft 0.2.0 as the measured peer of replica-level fault tolerance (issue 60).

N replica groups of one rank each, each its own process, train the same ~1M-parameter MLP
(four Linear layers, AdamW, synthetic data, fixed seed); torchft's lighthouse runs in a
process of its own. Each replica drives torchft's `Manager` by hand: `start_quorum`
(asynchronous, overlapping the forward pass), forward and backward, one all-reduce of the
flattened gradients through `Manager.allreduce` (torchft's reconfigurable gloo group),
`should_commit`, the optimizer step only when committed. torchft's `DistributedDataParallel`
wrapper is not used: in an outside run it crashed the survivor on every peer kill (`assert
fut._fut` after gloo's "Connection reset by peer"), so the harness has its own all-reduce.

Printed as a table and written as JSON with the settings and versions:
  overhead  torchft's median step over the plain loop's: the same step with torch.distributed's
            gloo all-reduce across the same N processes, no fault tolerance. Until the kill the
            two alternate in blocks of 5 steps, so a change of load on a shared machine hits
            both alike; each step's parts (quorum, compute, all-reduce, vote) are timed too;
  kill      one replica is SIGKILLed once it has committed step --kill-at: the time from the
            kill to each survivor's first step committed without it (the lighthouse waits
            out its heartbeat timeout, --heartbeat-timeout-s, 5 s by default), the survivors'
            largest gap between commits until then, their median step one replica short;
  rejoin    the killed replica restarts as a new process once every survivor has committed
            without it: from the spawn to its first committed step (interpreter, torch and
            torchft start-up, quorum, heal), and torchft's heal (the checkpoint fetched from a
            live peer over its HTTP transport) timed apart.

torchft is not an Optimus dependency: `make torchft-peer` installs it into .venv without
letting pip touch torch. Where it cannot run, the harness says why in one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from itertools import pairwise
from pathlib import Path

WIDTHS = (256, 768, 768, 256, 256)  # four Linear layers
PARAMS = sum(a * b + b for a, b in pairwise(WIDTHS))  # 1,050,624
SEED = 0
MARK = "@replica "  # prefixes a worker's event lines on its stdout (torchft may print too)
BLOCK = 5  # plain and torchft steps alternate in blocks of this many until the kill
FULL = {"steps": 60, "kill_at": 40, "batch": 64}  # ~50-100 ms steps on this 2-core VM
QUICK = {"steps": 16, "kill_at": 10, "batch": 32}
TORCHFT_PARTS = ("quorum", "forward_backward", "allreduce", "should_commit", "optimizer")
STOP_MARGIN = 5  # steps between the harness's stop decision and the step every replica stops at


# -- one replica: a worker process ---------------------------------------------------------------

_emit_lock = threading.Lock()  # the heal's event comes from torchft's quorum thread


def emit(event: str, **fields) -> None:
    with _emit_lock:
        print(MARK + json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def build(batch: int, replica: int):
    """The model, its optimizer, one flat gradient buffer the parameters' grads are views of
    (so one all-reduce covers them all), and a few synthetic batches (this replica's shard)."""
    import torch
    from torch import nn

    torch.manual_seed(SEED)  # every replica starts from the same weights
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(pairwise(WIDTHS)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(WIDTHS) - 2 else [])
    model = nn.Sequential(*layers)
    flat = torch.zeros(PARAMS)
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(SEED + 1 + replica)
    data = [(torch.randn(batch, WIDTHS[0], generator=g),
             torch.randn(batch, WIDTHS[-1], generator=g)) for _ in range(4)]
    return model, optimizer, flat, data


def forward_backward(model, data, step: int) -> float:
    import torch.nn.functional as F

    x, y = data[step % len(data)]
    loss = F.mse_loss(model(x), y)
    loss.backward()  # accumulates into the views of the flat buffer
    return loss.item()


def plain_step(model, optimizer, flat, data, step: int, world: int) -> None:
    """The reference: the same step over torch.distributed's gloo, no fault tolerance."""
    import torch.distributed as dist

    t = [time.perf_counter()]
    loss = forward_backward(model, data, step)
    t.append(time.perf_counter())
    dist.all_reduce(flat)
    flat /= world
    t.append(time.perf_counter())
    optimizer.step()
    flat.zero_()
    t.append(time.perf_counter())
    emit("commit", loop="plain", step=step, seconds=t[-1] - t[0], loss=loss,
         parts=laps(t, ("forward_backward", "allreduce", "optimizer")))


def laps(marks: list[float], names: tuple[str, ...]) -> dict[str, float]:
    """The time between successive marks, by name."""
    return dict(zip(names, (b - a for a, b in pairwise(marks)), strict=True))


def torchft_step(manager, model, optimizer, flat, data) -> bool:
    """One step as torchft drives it: quorum (asynchronous), forward and backward, the
    gradients' all-reduce through the Manager, the vote, the optimizer step if committed."""
    t = [time.perf_counter()]
    manager.start_quorum()
    t.append(time.perf_counter())
    loss = forward_backward(model, data, manager.current_step())
    t.append(time.perf_counter())
    manager.allreduce(flat).wait()  # torchft's allreduce (it waits for the quorum): the mean
    t.append(time.perf_counter())
    committed = manager.should_commit()
    t.append(time.perf_counter())
    if committed:
        optimizer.step()
        t.append(time.perf_counter())
        emit("commit", loop="torchft", step=manager.current_step(), seconds=t[-1] - t[0],
             loss=loss, participants=manager.num_participants(), parts=laps(t, TORCHFT_PARTS))
    else:
        emit("skip", step=manager.current_step(), error=str(manager.errored())[:200])
    flat.zero_()
    return committed


def make_manager(args, model, optimizer):
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torch.utils._pytree import tree_leaves
    from torchft import Manager
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.process_group import ProcessGroupGloo

    class TimedTransport(HTTPTransport):
        """torchft's HTTP checkpoint transport, its fetch (the heal) timed."""

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            start = time.perf_counter()
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            emit("heal", seconds=time.perf_counter() - start, step=step, bytes=sum(
                t.nbytes for t in tree_leaves(state) if isinstance(t, torch.Tensor)))
            return state

    timeout = timedelta(seconds=60)  # torchft's default, for its collectives and RPCs
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   optimizer.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        min_replica_size=1, timeout=timeout, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}", hostname="127.0.0.1",
        checkpoint_transport=TimedTransport(timeout=timeout, num_chunks=0))
    return manager, store  # the store serves while the caller holds it


def replica_main(args) -> None:
    """One replica. Until torchft step --kill-at, blocks of plain and torchft steps alternate
    (a change of load on a shared machine hits both loops alike); then torchft's steps only,
    until the step the harness's stop file names."""
    import torch.distributed as dist

    model, optimizer, flat, data = build(args.batch, args.replica)
    if args.port:  # one of the first replicas: the plain loop's group too
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.replica, world_size=args.replicas)
    manager, _store = make_manager(args, model, optimizer)
    emit("ready")
    if args.port:
        sys.stdin.readline()  # the harness starts the first replicas' steps at once
    stop, plain, committed = Path(args.stop_file), 0, True
    while not (stop.exists() and manager.current_step() >= int(stop.read_text())):
        step = manager.current_step()
        if args.port and committed and step % BLOCK == 0 and step < args.kill_at:
            for _ in range(BLOCK):
                plain += 1
                plain_step(model, optimizer, flat, data, plain, args.replicas)
        committed = torchft_step(manager, model, optimizer, flat, data)
    manager.shutdown(wait=False)


# -- the harness -------------------------------------------------------------------------------

class Replicas:
    """The worker processes of one run: their events arrive in one queue, each with the
    worker's name; each one's stderr goes to a log file, read when something fails."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.events: queue.Queue = queue.Queue()
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, argv: list[str]) -> float:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        started = time.time()
        with open(self.logs / f"{name}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, __file__, *argv], env=env, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self.procs[name] = proc
        threading.Thread(target=self._read, args=(name, proc), daemon=True).start()
        return started

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith(MARK):
                self.events.put((name, json.loads(line[len(MARK):])))
        self.events.put((name, {"event": "exit", "t": time.time()}))

    def next(self, deadline: float) -> tuple[str, dict]:
        try:
            return self.events.get(timeout=max(0.0, deadline - time.time()))
        except queue.Empty:
            raise RuntimeError("timed out waiting for the replicas; " + self.tail()) from None

    def tail(self, name: str | None = None) -> str:
        """The last lines of a failed process's log (`name`'s, or the first that failed)."""
        for n, proc in self.procs.items():
            if n == name or name is None and proc.poll() not in (None, 0, -signal.SIGKILL):
                lines = (self.logs / f"{n}.log").read_text().strip().splitlines()
                code = proc.wait(timeout=5)  # its output has ended: it is exiting
                return f"{n} exited {code}: " + " | ".join(lines[-2:])[-400:]
        return "no replica failed"

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def run(settings: dict, logs: Path) -> dict:
    """N replicas, torchft's lighthouse, the kill and the restart; the figures."""
    n, victim = settings["replicas"], f"r{settings['replicas'] - 1}"
    with socket.socket() as s:  # the plain loop's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    survivors, replicas, stop = [f"r{r}" for r in range(n - 1)], Replicas(logs), logs / "stop"
    measured: dict[str, list[dict]] = {"plain": [], "torchft": []}  # the overhead's steps
    commits: dict[str, list[tuple]] = {}  # step, time, duration, participants
    skips: dict[str, int] = {}
    heal: dict = {}
    mark: dict[str, float] = {}  # kill; spawn and ready of the restarted replica
    try:
        replicas.spawn("lighthouse", ["lighthouse", str(settings["heartbeat_timeout_s"] or "")])
        deadline = time.time() + settings["timeout_s"]
        name, e = replicas.next(deadline)
        if e["event"] != "lighthouse":
            raise RuntimeError("its lighthouse did not start; " + replicas.tail(name))
        lighthouse = e["address"]

        def argv(r: int, first: bool) -> list[str]:
            return ["worker", json.dumps({
                "replica": r, "replicas": n, "batch": settings["batch"], "lighthouse": lighthouse,
                "kill_at": settings["kill_at"], "port": port if first else 0,
                "stop_file": str(stop)})]
        for r in range(n):
            replicas.spawn(f"r{r}", argv(r, True))
        ready = 0
        while ready < n:
            name, e = replicas.next(deadline)
            if e["event"] == "exit":
                raise RuntimeError(replicas.tail(name))
            ready += e["event"] == "ready"
        for proc in (replicas.procs[f"r{r}"] for r in range(n)):
            proc.stdin.write("go\n")
            proc.stdin.flush()
        stopping, exited = None, set()
        while exited != set(replicas.procs) - {"lighthouse"}:
            name, e = replicas.next(deadline)
            kind = e["event"]
            if kind == "commit" and BLOCK < e["step"] <= settings["kill_at"]:
                measured[e["loop"]].append(e)  # the first block of each loop is a warm-up
            if kind == "commit" and e["loop"] == "torchft":
                commits.setdefault(name, []).append(
                    (e["step"], e["t"], e["seconds"], e["participants"]))
            elif kind == "skip" and "kill" in mark:
                skips[name] = skips.get(name, 0) + 1
            elif kind == "heal" and name == "rejoined":
                heal = {"heal_s": e["seconds"], "heal_bytes": e["bytes"], "heal_at_step": e["step"]}
            elif kind == "ready":
                mark["ready"] = e["t"]
            elif kind == "exit":
                exited.add(name)
                if name != victim and stopping is None:
                    raise RuntimeError(f"{name} exited before the end; " + replicas.tail(name))
            if "kill" not in mark and name == victim and kind == "commit" \
                    and e.get("loop") == "torchft" and e["step"] >= settings["kill_at"]:
                mark["kill"] = time.time()
                replicas.procs[victim].send_signal(signal.SIGKILL)
            if "kill" in mark and "spawn" not in mark and all(  # every survivor recovered
                    c[1] > mark["kill"] and c[3] < n for s in survivors for c in commits[s][-1:]):
                mark["spawn"] = replicas.spawn("rejoined", argv(n - 1, False))
            done = commits[survivors[0]][-1][0] if commits.get(survivors[0]) else 0
            if stopping is None and len(commits.get("rejoined", ())) >= settings["after_rejoin"] \
                    and done >= settings["steps"]:
                stopping = done + STOP_MARGIN
                (logs / "stop.tmp").write_text(str(stopping))
                (logs / "stop.tmp").rename(stop)
    finally:
        replicas.close()
    overhead = {loop: medians(events) for loop, events in measured.items()}
    return {"plain": overhead["plain"],
            "torchft": overhead["torchft"] | measure(
                settings, overhead["torchft"]["median_step_s"], commits, skips, heal, mark,
                replicas.procs[victim].returncode)}


def medians(events: list[dict]) -> dict:
    """The median step of a loop, and the median of each of its parts."""
    return {"median_step_s": statistics.median(e["seconds"] for e in events),
            "samples": len(events),
            "parts_s": {part: statistics.median(e["parts"][part] for e in events)
                        for part in events[0]["parts"]}}


def measure(settings, step_s, commits, skips, heal, mark, victim_exit) -> dict:
    """The kill's and the rejoin's figures, from the replicas' commits (step, time, duration,
    participants): a survivor has recovered at its first commit with fewer than N replicas."""
    n = settings["replicas"]
    rejoined = commits["rejoined"]
    survivors = {name: c for name, c in commits.items() if name not in (f"r{n - 1}", "rejoined")}
    to_next, stall, shrunk, across_rejoin = [], [], [], []
    for c in survivors.values():
        alone = [(t, seconds) for _, t, seconds, p in c if t > mark["kill"] and p < n]
        to_next.append(alone[0][0] - mark["kill"])
        last = max(t for _, t, _, _ in c if t <= mark["kill"])
        stall.append(max(b - a for a, b in pairwise(
            [t for _, t, _, _ in c if last <= t <= alone[0][0]])))
        shrunk += [seconds for t, seconds in alone[1:] if t < rejoined[0][1]]
        across_rejoin += [b - a for a, b in pairwise(t for _, t, _, _ in c if t >= mark["spawn"])]
    return {
        "kill": {"after_step": settings["kill_at"], "victim_exit": victim_exit,
                 "victim_last_step": commits[f"r{n - 1}"][-1][0], "survivors": len(survivors),
                 "survivor_commits_after_kill": min(
                     sum(t > mark["kill"] for _, t, _, _ in c) for c in survivors.values()),
                 "kill_to_next_commit_s": max(to_next),
                 "largest_gap_s": max(stall), "largest_gap_steps": max(stall) / step_s,
                 "survivor_skipped_steps": max(skips.values(), default=0),
                 "survivor_median_step_s": statistics.median(shrunk) if shrunk else None},
        "rejoin": {"spawn_to_first_commit_s": rejoined[0][1] - mark["spawn"],
                   "spawn_to_ready_s": mark["ready"] - mark["spawn"],
                   "first_commit_step": rejoined[0][0], "commits": len(rejoined),
                   "first_commit_participants": rejoined[0][3],  # the heal step: N - 1
                   "spawn_to_contributing_s": next(  # its first step with its own gradients
                       t for _, t, _, p in rejoined if p == n) - mark["spawn"],
                   "survivor_largest_gap_s": max(across_rejoin), **heal},
    }


def lighthouse_main(heartbeat_timeout_s: str) -> None:
    """torchft's lighthouse, in its own process (its log in a file), with the join timeout of
    torchft's `torchft_lighthouse` command (60 s: the Python binding's default is 100 ms).
    Its extension is loaded without the torchft package, which would import torch."""
    package = importlib.util.find_spec("torchft")
    path = next(Path(package.submodule_search_locations[0]).glob("_torchft*.so"))
    spec = importlib.util.spec_from_file_location("torchft._torchft", path)
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    timeout_ms = int(float(heartbeat_timeout_s) * 1000) if heartbeat_timeout_s else None
    server = native.LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000,
                                     heartbeat_timeout_ms=timeout_ms)
    emit("lighthouse", address=server.address())
    sys.stdin.read()  # until the harness ends this process
    server.shutdown()


def table(r: dict) -> str:
    plain, ft, s = r["plain"], r["torchft"], r["settings"]
    kill, rejoin = ft["kill"], ft["rejoin"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f} ms"

    def parts(loop: dict) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {ms(v)}" for k, v in loop["parts_s"].items())

    rows = [
        ("plain gloo loop, median step", f"{ms(plain['median_step_s'])} ({parts(plain)})"),
        ("torchft, median step", f"{ms(ft['median_step_s'])} ({parts(ft)})"),
        ("torchft / plain (medians)", f"{r['overhead_ratio']:.2f}x"),
        ("kill -> survivors' next commit", f"{kill['kill_to_next_commit_s']:.2f} s"),
        ("survivors' gap across the kill",
         f"{kill['largest_gap_s']:.2f} s = {kill['largest_gap_steps']:.0f} median steps"),
        (f"survivors' median step, {s['replicas'] - 1} replicas",
         ms(kill["survivor_median_step_s"])),
        ("restart: spawn -> first commit (rejoin)", f"{rejoin['spawn_to_first_commit_s']:.2f} s"),
        ("  of which spawn -> Manager ready", f"{rejoin['spawn_to_ready_s']:.2f} s"),
        ("  of which torchft's heal (fetch)", f"{ms(rejoin.get('heal_s'))}, "
         f"{rejoin.get('heal_bytes', 0) / 1e6:.1f} MB"),
        ("restart: spawn -> first step with its gradient",
         f"{rejoin['spawn_to_contributing_s']:.2f} s"),
        ("survivors' largest gap after the restart", f"{rejoin['survivor_largest_gap_s']:.2f} s"),
    ]
    timeout = s["heartbeat_timeout_s"] or "torchft's default 5"
    head = (f"torchft {r['versions']['torchft']}, torch {r['versions']['torch']}: "
            f"{s['replicas']} replicas x 1 rank, {r['params'] / 1e6:.2f}M-parameter MLP, "
            f"batch {s['batch']}, kill after step {s['kill_at']}, heartbeat timeout {timeout} s, "
            f"{r['machine']['cpus']} CPUs")
    width = max(len(k) for k, _ in rows)
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, help="the least step the run reaches (60; quick 16)")
    p.add_argument("--kill-at", type=int, help="the step one replica dies after (40; quick 10)")
    p.add_argument("--batch", type=int, help="samples per replica and step (64; quick 32)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=None,
                   help="the lighthouse's heartbeat timeout (default: torchft's, 5 s)")
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="a short check (< 60 s on 2 cores)")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.replicas < 2 or not BLOCK < args.kill_at < args.steps or args.batch < 1:
        p.error(f"needs --replicas >= 2, {BLOCK} < --kill-at < --steps, --batch >= 1")
    if args.heartbeat_timeout_s is not None and args.heartbeat_timeout_s <= 0:
        p.error("--heartbeat-timeout-s must be positive")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse(argv)
    settings = {"replicas": args.replicas, "steps": args.steps, "kill_at": args.kill_at,
                "batch": args.batch, "heartbeat_timeout_s": args.heartbeat_timeout_s,
                "after_rejoin": 5 if args.quick else 20, "quick": args.quick,
                "timeout_s": 150 if args.quick else 600}
    if importlib.util.find_spec("torchft") is None:
        print("replica_peer: torchft is not installed in this environment; "
              "`make torchft-peer` installs it", file=sys.stderr)
        return None
    logs = Path(tempfile.mkdtemp(prefix="replica_peer_"))
    try:
        figures = run(settings, logs)
    except RuntimeError as e:  # a replica failed or stalled: the one line that says why
        print(f"replica_peer: torchft {metadata.version('torchft')} could not run here: {e} "
              f"(logs in {logs})", file=sys.stderr)
        return None
    shutil.rmtree(logs)
    results = {"settings": settings, "params": PARAMS,
               "versions": {v: metadata.version(v) for v in ("torch", "torchft")}
               | {"python": sys.version.split()[0]},
               "machine": {"cpus": os.cpu_count()}, **figures,
               "overhead_ratio": figures["torchft"]["median_step_s"]
               / figures["plain"]["median_step_s"]}
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


def worker_main(config: str) -> None:
    import torch

    torch.set_num_threads(1)
    replica_main(argparse.Namespace(**json.loads(config)))
    sys.stdout.flush()
    os._exit(0)  # torchft's threads (quorum, heartbeats, its HTTP server) need not be joined


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker_main(sys.argv[2])
    elif sys.argv[1:2] == ["lighthouse"]:
        lighthouse_main(sys.argv[2])
    else:
        sys.exit(0 if main() is not None else 1)
