"""A kernel library that a killed compile left empty in inductor's cache (optimus/parallel/
compile.py `drop_broken_kernels`): every later compile of that graph on the host loaded it and
failed ("file too short"), so a rank killed in its first steps broke every later generation
(CI, after a run was killed mid-compile). Real compiles in real processes, one cache folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from optimus.parallel.compile import drop_broken_kernels

ROOT = Path(__file__).resolve().parents[1]
TRAIN = """
import torch
from torch import nn
from optimus.parallel.compile import apply_compile


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 8)

    def forward(self, x):
        return torch.sin(self.w(x)) * 2 + 1


torch.manual_seed(0)
model = nn.Module()
model.layers = nn.ModuleDict({"0": Block()})
apply_compile(model)
with torch.no_grad():
    print(float(model.layers["0"](torch.ones(2, 8)).sum()))
"""

def _compile(cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", TRAIN], env=env, capture_output=True,
                          text=True, timeout=600)


def test_an_empty_kernel_library_left_by_a_killed_compile_is_built_again(tmp_path):
    cache = tmp_path / "inductor"
    first = _compile(cache)
    assert first.returncode == 0, first.stderr[-3000:]
    libraries = list(cache.glob("*/*.so"))
    assert libraries
    old = time.time() - 3600
    for path in libraries:  # as a compile killed while it wrote them leaves them
        path.write_bytes(b"")
        os.utime(path, (old, old))
    again = _compile(cache)  # the trainer's compile sweeps them first
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == first.stdout
    assert "removed" in again.stderr and "empty kernel librar" in again.stderr
    assert all(p.stat().st_size > 0 for p in cache.glob("*/*.so"))


def test_only_old_empty_libraries_go(tmp_path):
    """A young empty file may be another rank's compile in progress; other files stay."""
    (tmp_path / "ab").mkdir()
    old, young, whole, other = (tmp_path / "ab" / n for n in ("o.so", "y.so", "w.so", "e.cpp"))
    for path in (old, young, other):
        path.write_bytes(b"")
    whole.write_bytes(b"\x7fELF")
    for path in (old, whole, other):
        os.utime(path, (time.time() - 120, time.time() - 120))
    assert drop_broken_kernels(tmp_path) == [old]
    assert sorted(p.name for p in (tmp_path / "ab").iterdir()) == ["e.cpp", "w.so", "y.so"]
    assert drop_broken_kernels(tmp_path / "missing") == []
