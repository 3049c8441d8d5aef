"""bench/moe.py end to end on a small MoE job: the figures it prints are the ones the docs
quote (bytes fewer than before, ops flat in the experts, deduplicated all-to-all bytes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_the_moe_bench_runs_on_a_small_job_and_meets_its_cpu_targets(tmp_path):
    job = yaml.safe_load((ROOT / "jobs" / "mula-7b-a1b.yaml").read_text())
    job["model"].update(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=512)
    job["model"]["moe"].update(experts=16, expert_ffn_dim=64)
    path = tmp_path / "small-moe.yaml"
    path.write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "bench/moe.py", "--job", str(path), "--world", "768",
                           "--tokens", "128", "--repeat", "1", "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    fewer = float(re.search(r"bytes/token ([\d.]+)x fewer", out).group(1))
    assert fewer >= 2.0, out
    ops = re.search(r"8 experts (\d+), 64 experts (\d+): flat", out)
    assert ops and ops.group(1) == ops.group(2), out
    for ep in (2, 4):
        ratio = float(re.search(rf"EP {ep}: sent .* undeduplicated .*: ([\d.]+)x", out).group(1))
        assert 0 < ratio < 1, out
