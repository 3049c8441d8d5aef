"""bench/context_parallel.py --quick end to end: every layout's loss and gradients are one
process's, the bytes each method sends are what its exchange must move, and both methods
split the activations over cp. No assertion on times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.context_parallel import failures  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "cp.json"
    done = subprocess.run([sys.executable, "bench/context_parallel.py", "--quick", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def line(figures: list[dict], seq: int, method: str, cp: int) -> dict:
    (found,) = [f for f in figures if (f["seq"], f["method"], f["cp"]) == (seq, method, cp)]
    return found


def test_every_layout_trains_like_one_process_and_sends_what_its_exchange_moves(quick):
    got, table = quick
    spec, figures = got["spec"], got["figures"]
    assert spec["seqs"] == [256, 1024] and spec["heads"] == 8 and spec["kv_heads"] == 4
    kv_share = spec["kv_heads"] / spec["heads"]
    rows = [f for f in figures if f["cp"] > 1]
    assert {(f["method"], f["cp"]) for f in rows} == {(m, cp) for m in ("alltoall", "ring")
                                                      for cp in (2, 4)}
    for f in rows:
        assert f["loss_error"] <= 1e-5 and f["grad_error"] <= 1e-5, f
        cp = f["cp"]
        layer_input = spec["batch"] * f["seq"] // cp * spec["dim"] * 4  # fp32 bytes a rank
        if f["method"] == "alltoall":  # q, k, v, out; all but the rank's own 1/cp leaves,
            forward = backward = (cp - 1) / cp * (2 + 2 * kv_share) * layer_input  # both ways
        else:  # k and v (kv heads only) around the ring, cp - 1 shifts; back, around again
            # beside their gradients' accumulators, and one more shift home
            block = 2 * kv_share * layer_input
            forward, backward = (cp - 1) * block, (2 * cp - 1) * block
        assert f["sent_ranks"] == {"forward": [forward] * cp, "backward": [backward] * cp}, f
    assert "| 1024 | alltoall | 4 |" in table and "FAILED" not in table


def test_the_alltoall_splits_the_activations_over_cp(quick):
    figures = quick[0]["figures"]
    assert line(figures, 1024, "alltoall", 2)["held_ratio"] < 0.65
    assert line(figures, 1024, "alltoall", 4)["held_ratio"] < 0.4
    # One process's activations grow with the sequence (its SDPA keeps O(seq) per head):
    # the count is of the activations, not of something fixed.
    short, long = (line(figures, seq, "one process", 1)["held"] for seq in (256, 1024))
    assert 3.8 < long / short < 4.2, (short, long)


def test_the_ring_splits_the_activations_over_cp(quick):
    """Its backward recomputes each chunk pair's attention from the output and log-sum-exp:
    nothing of size sequence x sequence is held."""
    figures = quick[0]["figures"]
    assert line(figures, 1024, "ring", 2)["held_ratio"] < 0.65
    assert line(figures, 1024, "ring", 4)["held_ratio"] < 0.4


def test_a_wrong_loss_or_count_fails_the_run():
    right = {"seq": 256, "method": "ring", "cp": 2, "loss_error": 0.0, "grad_error": 1e-7,
             "formula": {"forward": 100, "backward": 300},
             "sent_ranks": {"forward": [100, 100], "backward": [300, 300]}}
    assert failures([right]) == []
    off = [{**right, "loss_error": 2e-5},
           {**right, "grad_error": float("nan")},
           {**right, "sent_ranks": {"forward": [100, 100], "backward": [300, 100]}}]
    found = failures(off)
    assert len(found) == 3
    assert "loss 2.0e-05" in found[0] and "gradients nan" in found[1]
    assert "backward sent [300, 100] bytes per layer by rank, the formula 300" in found[2]
