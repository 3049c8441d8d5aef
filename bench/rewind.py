"""What a loss spike costs with each action, measured on the same job in one run.

    python bench/rewind.py [--steps 60] [--spike 40]

Three runs of one small job under `optimus run` (two nodes of one rank, one spare; a
checkpoint every 10 steps, a memory snapshot every 2), the same seed:
- clean: no fault;
- warn: the batch of step --spike is poisoned (random tokens: the `spike` fault) and trained
  on (`on_spike: warn`);
- rewind: the same spike, `on_spike: rewind` (the controller resumes from before it, skipping
  its batch).
Printed: each run's final loss and wall time, the final loss against the clean run's (the
ratio), and for the rewind the seconds from the spike's verdict to the resumed generation's
first step and the steps trained again. Figures in docs/benchmarks.md ("Rewinds").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def job(run: Path, steps: int, spike: int | None, action: str) -> dict:
    return {
        "name": "bench-rewind", "seed": 1234, "run_dir": str(run),
        "model": {"vocab_size": 264, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 64},
        "optim": {"steps": steps, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5},
        "data": {"source": "synthetic", "seq_len": 64, "batch_size": 8, "microbatches": 1},
        "checkpoint": {"interval": 10, "keep_last": 100, "memory_every": 2},
        "supervision": {"log_every": 1, "heartbeat_interval_s": 0.25, "restart_backoff_s": 0.2,
                        "failure_grace_s": 1.0},
        "stability": {"warmup_steps": 8, "window": 8, "loss_min_rise": 0.5, "on_spike": action},
        "fault_injection": {"faults": [{"kind": "spike", "step": spike}] if spike else []},
        "monitoring": {"metrics_port": 0},
    }


def run_one(folder: Path, name: str, steps: int, spike: int | None, action: str) -> dict:
    run = folder / name
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job(run, steps, spike, action)))
    began = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "controller", "run", str(path), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - began
    if out.returncode:
        sys.exit(f"{name}: optimus run failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    lines = [json.loads(t) for t in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {m["step"]: m for m in lines if "loss" in m}  # the last generation's
    result = {"final": losses[steps]["loss"], "wall_s": wall}
    verdict = next((m for m in lines if m.get("event") == "stability"), None)
    if verdict is not None and action == "rewind":
        at = lines.index(verdict)
        resumed = next(m for m in lines[at:] if m.get("event") == "resume")
        first = next(m for m in lines[lines.index(resumed):] if "loss" in m)
        result["recovery_s"] = first["time"] - verdict["time"]
        result["retrained"] = verdict["step"] - 1 - resumed["step"]
        result["resumed_from"] = resumed["step"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--spike", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        runs = {name: run_one(folder, name, args.steps, spike, action)
                for name, spike, action in (("clean", None, "warn"),
                                            ("warn", args.spike, "warn"),
                                            ("rewind", args.spike, "rewind"))}
    clean = runs["clean"]["final"]
    print(f"{'run':<8} {'final loss':>10} {'/ clean':>8} {'wall s':>7}")
    for name, r in runs.items():
        print(f"{name:<8} {r['final']:>10.4f} {r['final'] / clean:>8.3f} {r['wall_s']:>7.1f}")
    r = runs["rewind"]
    print(f"rewind: resumed from step {r['resumed_from']}, {r['retrained']} step(s) trained "
          f"again; {r['recovery_s']:.2f} s from the verdict to the resumed generation's first "
          f"step; {r['wall_s'] - runs['clean']['wall_s']:+.1f} s of wall against the clean run")


if __name__ == "__main__":
    main()
