"""Recovery from in-memory snapshots under the whole control plane: a real redis-server, the
controller, agents (each holding its node's snapshots in shared memory and a buddy's copy) and
gloo ranks; faults are real SIGKILLs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import ROOT, metrics, write_job

from optimus.data.audit import audit_run

STEPS = 30
FAULT_STEP = 15
EVERY = 2


def _run(tmp_path: Path, fault: dict, spares: int = 1, **job) -> tuple[Path, str]:
    run = tmp_path / "run"
    path = write_job(tmp_path / "job.yaml", run, steps=STEPS, memory_every=EVERY,
                     faults=[{**fault, "step": FAULT_STEP}], **job)
    out = subprocess.run([sys.executable, "-m", "controller", "run", str(path), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", str(spares)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return run, out.stdout


def _events(run: Path, kind: str) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
            if json.loads(line).get("kind") == kind]


@pytest.mark.parametrize("fault", [{"kind": "kill_rank", "rank": 1},
                                   {"kind": "kill_node", "node": 1}],
                         ids=["kill_rank", "kill_node"])
def test_a_fault_resumes_from_the_memory_snapshot_not_the_disk(fault, tmp_path):
    run, out = _run(tmp_path, fault)
    resumes = [m for m in metrics(run) if m.get("event") == "resume"]
    assert len(resumes) == 1, resumes
    resume = resumes[0]
    assert resume["source"] == "memory", (resume, _events(run, "generation"))
    # The fault's step: a rank kills itself as it starts FAULT_STEP; a node's agent dies at the
    # first step >= FAULT_STEP its ranks' heartbeats show.
    died = FAULT_STEP
    if fault["kind"] == "kill_node":
        (chaos,) = [e for e in _events(run, "chaos") if "dies at step" in e["message"]]
        died = int(chaos["message"].rsplit(" ", 1)[1])
    # Lost: the steps since the last snapshot, and at worst one more interval (the snapshot
    # taken just before the fault may not have reached the buddy).
    assert died - 2 * EVERY <= resume["step"] < died, (died, resume)
    assert resume["step"] % EVERY == 0
    assert re.search(rf"generation 1 on .* from the memory snapshot of step {resume['step']}",
                     out), out
    audit = audit_run(run)  # every sample of the run read exactly once, across the restart
    assert audit.ok, audit.problems
    assert (audit.steps, audit.generations, audit.end) == (STEPS, 2, STEPS * 8)
    # Every shard was found where the plan said: held already by the node that needed it (the
    # spare is every node's buddy when it registered before generation 0 was planned), or
    # fetched from the node holding it (the other node's copy, when the buddies were each
    # other) — never a failed fetch.
    fetches = [e for e in _events(run, "snapshot") if "fetch" in e["message"]]
    assert not [e for e in fetches if "could not" in e["message"]], fetches
