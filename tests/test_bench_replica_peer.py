"""bench/replica_peer.py: torchft 0.2.0's replicas lose one to SIGKILL, go on, and take it back.

One quick run in a subprocess (three replica processes and torchft's lighthouse), its JSON
checked: the survivors commit without the killed replica only once the lighthouse's heartbeat
timeout has passed, the restarted replica heals from a survivor and commits in step with them,
and both loops' medians are real durations. Skipped where torchft is not installed
(`make torchft-peer`).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import replica_peer  # noqa: E402

HEARTBEAT_TIMEOUT_S = 1.0  # shorter than torchft's 5 s, to keep the test short


def test_a_killed_replica_costs_the_survivors_a_heartbeat_timeout_and_rejoins(tmp_path):
    pytest.importorskip("torchft", reason="torchft is the peer measured; `make torchft-peer`")
    out = tmp_path / "peer.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "replica_peer.py"), "--quick",
         "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    s, kill, rejoin = r["settings"], r["torchft"]["kill"], r["torchft"]["rejoin"]
    assert (s["replicas"], s["heartbeat_timeout_s"], s["quick"]) == (3, HEARTBEAT_TIMEOUT_S, True)
    assert r["versions"]["torchft"] == "0.2.0" and r["params"] == 1_050_624

    # both loops' steps were timed, after their warm-up block; the ratio is theirs
    for loop in (r["plain"], r["torchft"]):
        assert loop["samples"] == 3 * (s["kill_at"] - 5)
        assert 0 < loop["median_step_s"] < 5
        assert 0 < sum(loop["parts_s"].values()) <= 2 * loop["median_step_s"]
    assert math.isclose(r["overhead_ratio"],
                        r["torchft"]["median_step_s"] / r["plain"]["median_step_s"])
    assert set(r["torchft"]["parts_s"]) == {"quorum", "forward_backward", "allreduce",
                                            "should_commit", "optimizer"}

    # the victim died of SIGKILL after the step it was to die after; both survivors went on
    assert kill["victim_exit"] == -9 and kill["victim_last_step"] >= s["kill_at"]
    assert kill["survivors"] == 2 and kill["survivor_commits_after_kill"] >= 5
    # without the victim only once the lighthouse stopped counting it as alive
    assert kill["kill_to_next_commit_s"] >= 0.8 * HEARTBEAT_TIMEOUT_S
    assert kill["largest_gap_s"] >= 0.8 * HEARTBEAT_TIMEOUT_S
    assert kill["largest_gap_steps"] == pytest.approx(
        kill["largest_gap_s"] / r["torchft"]["median_step_s"])
    assert kill["survivor_median_step_s"] is None or kill["survivor_median_step_s"] > 0

    # the new process healed from a survivor (model and AdamW state: 3 x 4 bytes a parameter)
    # at a step past the kill and committed that step, to which (torchft's asynchronous
    # quorum) only the two survivors' gradients count; then steps with all three
    assert 0 <= rejoin["heal_bytes"] - 3 * 4 * r["params"] < 1024 and rejoin["heal_s"] > 0
    assert rejoin["heal_at_step"] > kill["victim_last_step"]
    assert rejoin["first_commit_step"] == rejoin["heal_at_step"] + 1
    assert rejoin["first_commit_participants"] == 2 and rejoin["commits"] >= 5
    assert 0 < rejoin["spawn_to_ready_s"] < rejoin["spawn_to_first_commit_s"]
    assert rejoin["spawn_to_first_commit_s"] < rejoin["spawn_to_contributing_s"]
    assert "restart: spawn -> first commit (rejoin)" in run.stdout


@pytest.mark.parametrize("argv", [["--kill-at", "5"], ["--kill-at", "60", "--steps", "60"],
                                  ["--replicas", "1"], ["--heartbeat-timeout-s", "0"]])
def test_bad_arguments_are_refused_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        replica_peer.parse(argv)
    assert e.value.code == 2 and "--" in capsys.readouterr().err


def test_quick_and_full_defaults_fill_only_what_is_not_given():
    quick = replica_peer.parse(["--quick", "--batch", "16"])
    assert (quick.steps, quick.kill_at, quick.batch) == (16, 10, 16)
    full = replica_peer.parse([])
    assert (full.steps, full.kill_at, full.batch, full.heartbeat_timeout_s) == (60, 40, 64, None)
