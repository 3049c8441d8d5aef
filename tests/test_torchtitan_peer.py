"""bench/torchtitan_peer.py on a CPU: where Optimus's figure comes from, and (where torchtitan
0.3.0 is installed) the peer itself, 3 steps of the tiny shape.

torchtitan is not among the dev extras: `pip install torchtitan==0.3.0` brings ~45 packages
(wandb, tensorboard, datasets, pandas, grpcio...), and its import path needs triton (a 600 MB
package, imported, not run, on a CPU), which a CPU torch does not bring. The run below then
skips, saying why; the device machine has it all (bench/gpu.sh, `make gpu-wheels`). To run it
here, into a folder of its own:
    pip install --no-deps --target /tmp/tt torchtitan==0.3.0 spmd-types==0.2.3 tyro==1.0.17 \
        docstring-parser==0.18.0 triton
    PYTHONPATH=/tmp/tt pytest tests/test_torchtitan_peer.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.mfu import SMALL  # noqa: E402
from bench.torchtitan_peer import MODE, flex_problem, optimus_figure  # noqa: E402

TINY = {**SMALL, "seq_len": 256, "batch_size": 4}  # the peer's --tiny shape, as mfu.json has it


def mfu_json(path: Path, shape: dict, **mode_entry) -> Path:
    path.write_text(json.dumps({"shape": shape, "modes": mode_entry,
                                "failed": {"compiled-float8-none": "OutOfMemoryError"}}))
    return path


def test_optimus_figure_is_bench_mfu_s_compiled_bf16_at_the_same_shape(tmp_path):
    entry = {"optimus": {"tokens_per_s": 61_819.0}, "reference": {"tokens_per_s": 69_295.0}}
    good = mfu_json(tmp_path / "mfu.json", TINY, **{MODE: entry})
    assert optimus_figure(good, TINY) == (61_819.0, f"bench/mfu.py's {MODE}, mfu.json")
    assert optimus_figure(None, TINY) == (None, "no --mfu-json")
    value, why = optimus_figure(tmp_path / "absent.json", TINY)
    assert value is None and "does not exist" in why
    value, why = optimus_figure(good, {**TINY, "seq_len": 2048})
    assert value is None and "another shape" in why
    other = mfu_json(tmp_path / "other.json", TINY, **{"eager-bf16-none": entry})
    assert optimus_figure(other, TINY) == (None, f"{other} has no {MODE} figure")


def test_flex_attention_is_refused_where_it_cannot_train():
    assert flex_problem(torch.device("cpu")) == "FlexAttention has no backward on a CPU"


def torchtitan_problem() -> str | None:
    """Why torchtitan cannot be imported the way the peer imports it here, or None."""
    done = subprocess.run([sys.executable, "-c", "from bench.torchtitan_peer import "
                           "import_torchtitan; import_torchtitan()"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    return None if done.returncode == 0 else lines[-1] if lines else f"exit {done.returncode}"


def test_the_peer_runs_three_steps_of_the_tiny_shape_and_sets_optimus_beside_it(tmp_path):
    why = torchtitan_problem()
    if why:
        pytest.skip(f"torchtitan 0.3.0 is not importable here: {why}")
    mfu = mfu_json(tmp_path / "mfu.json", TINY,
                   **{MODE: {"optimus": {"tokens_per_s": 2_000.0}}})
    out = tmp_path / "tt.json"
    done = subprocess.run([sys.executable, "bench/torchtitan_peer.py", "--device", "cpu",
                           "--tiny", "--steps", "3", "--mfu-json", str(mfu), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["version"], r["attention"], r["mode"]) == ("0.3.0", "sdpa", "eager-bf16-none")
    assert r["shape"] == TINY and r["params"] == 5_048_576  # as Optimus counts SMALL
    assert len(r["step_times_s"]) == 1  # 3 steps: 1 dropped, 1 timed, 1 closes the window
    assert r["tokens_per_s"] == pytest.approx(4 * 256 / r["step_s"])
    assert r["ratio"] == pytest.approx(2_000.0 / r["tokens_per_s"])
    assert r["syncs"] is None and r["mfu"] is None  # a CPU: no count, no peak
    # a fresh model of a 4,096-token vocabulary starts near ln(4096) = 8.32
    assert 7.8 < r["first_loss"] < 8.9
    assert f"Optimus / torchtitan: {r['ratio']:.3f} (Optimus 2,000 tok/s" in done.stdout
