"""Replicas that carry on, rank side: what a lost replica costs the others with
optimus/parallel/replicas.py, against a plain loop and against torchft 0.2.0, in one run.

N replicas of one rank each (separate processes) train the ~1M-parameter MLP of
bench/replica_peer.py (widths 256-768-768-256-256, batch 128, AdamW) through
bench/replica_rank.py. This script plays the controller's part: it serves the store the quorum
groups meet at and writes the quorum file, at once on each decision (the controller's own
decision time is not in these figures). Measured:

  overhead   before the kill, blocks of 5 steps alternate in the same processes between the
             quorum's exchange and a bare all-reduce of the same buffer on the same group
             (what a plain data-parallel loop does): the ratio of their median steps, target
             <= 1.02; and, which the other ranks' share of the cores does not blur, the host
             work the quorum's exchange adds (the calling thread's CPU time, median against
             the bare all-reduce's) over the bare step;
  gap        replica N-1 is SIGKILLed after step --kill-at; the quorum without it is written
             when its exit is seen: the survivors' largest gap between applied steps, in
             seconds and in median steps (target <= 2), and kill -> their next applied step,
             in two parts: the victim's teardown (kill -> reaped: its sockets close with its
             address space) and the survivors' own (their exchange failing -> next step);
  rejoin     a standby for the lost replica (a process started with the others, past its
             imports) is let back in once the survivors have stepped 5 more times: from the
             quorum naming it to its first applied step, and its heal (group, agreement and
             the state from the lowest live member, checked).

With --peer (torchft installed: `make torchft-peer`), bench/replica_peer.py runs the same kill
with torchft in the same run, and the ratios are printed: survivors' gap, per-step overhead and
rejoin (ours over torchft's: below 1 is better).

    .venv/bin/python bench/replicas.py [--replicas 3] [--steps 80] [--kill-at 40] [--peer]
                                       [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from replica_run import ROOT, Run  # noqa: E402

WIDTHS = "256,768,768,256,256"  # bench/replica_peer.py's MLP: 1,051,904 parameters
FULL = {"steps": 80, "kill_at": 40, "rows": 64}  # batch 64, as bench/replica_peer.py's
QUICK = {"steps": 24, "kill_at": 8, "rows": 32}


def step_times(run: Run, replica: int) -> list[tuple[int, float]]:
    return [(r["step"], r["time"]) for r in run.lines(replica)]


def ours(tmp: Path, replicas: int, steps: int, kill_at: int, rows: int) -> dict:
    run = Run(tmp, steps, args=("--widths", WIDTHS, "--rows", str(rows),
                                "--alternate-until", str(kill_at - 2)))
    lost = replicas - 1
    try:
        standby = run.start(lost, 1)  # past its imports, waiting for a later quorum
        run.wait(lambda: run.ready(lost, 1))
        run.quorum(list(range(replicas)))
        for r in range(replicas):
            run.start(r)
        victim = run.procs[lost, 0]
        run.wait(lambda: run.last_step(lost) >= kill_at)
        killed = time.time()
        victim.kill()
        victim.wait()
        reaped = time.time()  # its sockets closed: a survivor's exchange can see it now
        run.quorum(list(range(lost)))
        run.wait(lambda: run.last_step(0) >= run.last_step(lost) + 5)
        let_in = time.time()
        run.quorum(list(range(replicas)))
        run.finish([*(run.procs[r, 0] for r in range(lost)), *standby])
        times = step_times(run, 0)
        before = [b - a for (_, a), (_, b) in pairwise(times) if b < killed][2:]
        median = statistics.median(before)
        warm = [r for r in run.lines(0) if 5 < r["step"] <= kill_at - 2]  # past a block
        bare = statistics.median(r["seconds"] for r in warm if r["bare"])
        quorum = statistics.median(r["seconds"] for r in warm if not r["bare"])
        # The host work the quorum's exchange adds to a bare all-reduce's (the calling
        # thread's CPU time, which the other ranks' share of two cores does not blur).
        added = statistics.median(r["exchange_cpu_s"] for r in warm if not r["bare"]) - \
            statistics.median(r["exchange_cpu_s"] for r in warm if r["bare"])
        after = next(t for _, t in times if t > killed)
        failed = [f["time"] for f in run.lines(0, kind="failed") if f["time"] > killed]
        gap = max(b - a for (_, a), (_, b) in pairwise(times) if b <= let_in)
        rejoin_gap = max(b - a for (_, a), (_, b) in pairwise(times) if b > let_in)
        joined = [t for s, t in step_times(run, lost) if t > let_in]
        heal = [f for f in run.lines(lost, kind="formed") if f["healed"]]
        return {"median_step_s": median, "gap_s": gap, "gap_steps": gap / median,
                "rejoin_gap_s": rejoin_gap, "rejoin_gap_steps": rejoin_gap / median,
                "kill_to_next_step_s": after - killed,
                # The kill's own cost, not the survivors': the OS tearing the victim down
                # (its sockets close with its address space, tens of ms for a torch process),
                # and the survivors' part: from their exchange failing to their next step.
                "teardown_s": reaped - killed,
                "failed_to_next_step_s": after - failed[0] if failed else None,
                "rejoin_s": joined[0] - let_in if joined else None,
                "heal_s": heal[-1]["heal_s"] if heal else None,
                "steps_applied": len(times), "bare_step_s": bare, "quorum_step_s": quorum,
                "overhead_same_processes": quorum / bare,
                "added_host_s": added, "overhead_host": 1 + added / bare}
    finally:
        run.kill_all()


def peer(args, settings: dict, tmp: Path) -> dict | None:
    out = tmp / "peer.json"
    cmd = [sys.executable, str(ROOT / "bench" / "replica_peer.py"),
           "--replicas", str(args.replicas), "--steps", str(settings["steps"]),
           "--kill-at", str(settings["kill_at"]), "--batch", str(settings["rows"]),
           "--json", str(out)]
    if args.quick:
        cmd.append("--quick")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not out.exists():
        print(f"torchft peer: not measured ({(done.stdout + done.stderr).strip()[-300:]})")
        return None
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--quick", action="store_true", help="a check that it runs")
    p.add_argument("--peer", action="store_true", help="torchft 0.2.0 in the same run")
    p.add_argument("--json")
    a = p.parse_args()
    settings = dict(QUICK if a.quick else FULL)
    settings.update({k: v for k, v in (("steps", a.steps), ("kill_at", a.kill_at)) if v})
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        (base / "ours").mkdir()
        figures = ours(base / "ours", a.replicas, settings["steps"], settings["kill_at"],
                       settings["rows"])
        figures["overhead"] = figures["overhead_same_processes"]
        theirs = peer(a, settings, base) if a.peer else None
    print(f"replicas {a.replicas}, steps {settings['steps']}, kill after step "
          f"{settings['kill_at']}, MLP {WIDTHS}, batch {settings['rows']}")
    print(f"  bare all-reduce step        {figures['bare_step_s'] * 1e3:8.1f} ms  (median)")
    print(f"  ours: quorum exchange step  {figures['quorum_step_s'] * 1e3:8.1f} ms  "
          f"(overhead {figures['overhead']:.3f}x, target <= 1.02)")
    print(f"  ours: host work it adds     {figures['added_host_s'] * 1e3:8.2f} ms a step "
          f"({figures['overhead_host']:.3f}x the bare step)")
    print(f"  ours: survivors' largest gap {figures['gap_s']:7.3f} s = "
          f"{figures['gap_steps']:.2f} median steps (target <= 2)")
    print(f"  ours: kill -> next step     {figures['kill_to_next_step_s']:8.3f} s: the victim's "
          f"teardown (kill -> reaped) {figures['teardown_s']:.3f} s; the survivor's exchange "
          f"failing -> its next step {_s(figures['failed_to_next_step_s'])}")
    print(f"  ours: rejoin (standby)      {figures['rejoin_s']:8.3f} s, heal "
          f"{figures['heal_s']:.3f} s; survivors' largest gap then {figures['rejoin_gap_s']:.3f}"
          f" s = {figures['rejoin_gap_steps']:.2f} median steps")
    result = {"settings": {**settings, "replicas": a.replicas, "widths": WIDTHS},
              "ours": figures, "torchft": theirs}
    if theirs:
        ratios = _ratios(figures, theirs)
        result["ratios"] = ratios
        for name, value in ratios.items():
            print(f"  ours / torchft {name:<20} {value:.3f}" if value is not None
                  else f"  ours / torchft {name:<20} n/a")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.3f} s"


def _ratios(ours_: dict, theirs: dict) -> dict:
    """Ours over torchft's (bench/replica_peer.py's JSON), for each figure both have (below 1:
    ours is better). Rejoin: ours from the quorum naming a ready standby, torchft's from the
    restarted process's spawn (it has no standby)."""
    ft = theirs.get("torchft", {})
    kill, rejoin = ft.get("kill", {}), ft.get("rejoin", {})

    def ratio(mine, value):
        return mine / value if mine is not None and value else None
    return {"survivors' gap": ratio(ours_["gap_s"], kill.get("largest_gap_s")),
            "kill to next step": ratio(ours_["kill_to_next_step_s"],
                                       kill.get("kill_to_next_commit_s")),
            "per-step overhead": ratio(ours_["overhead"], theirs.get("overhead_ratio")),
            "rejoin": ratio(ours_["rejoin_s"], rejoin.get("spawn_to_first_commit_s")),
            "heal": ratio(ours_["heal_s"], rejoin.get("heal_s"))}


if __name__ == "__main__":
    main()
