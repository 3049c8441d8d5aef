"""What the GPU machines' torch (2.11) does differently from the pinned 2.13, on this CPU.

Each difference below was met on an H200 running the image's torch 2.11 (docs/gpu.md); each
test makes this torch behave the way 2.11 did, or checks the piece that 2.11 needs, so CI keeps
the fallback working without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from cluster import ROOT, write_job

from optimus.checkpoint.manifest import committed_steps


def test_process_saves_commit_when_torch_closes_the_stager_after_each_save(tmp_path):
    """torch 2.11's async_save closes the stager it is given after every save; 2.13 leaves it
    open. The shared stager survives that: every save of a process-mode run commits (DCP's
    own stager failed the second with `KeyError: <class 'type'>`)."""
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=8, async_mode="process")
    raw = yaml.safe_load(job.read_text())
    raw["checkpoint"].update({"interval": 2, "on_overlap": "wait",
                              "dir": str(tmp_path / "ckpt")})
    job.write_text(yaml.safe_dump(raw))
    code = textwrap.dedent(f"""
        import torch.distributed.checkpoint as dcp
        from optimus.checkpoint import saver
        from optimus.config import load_job
        from optimus.train import train

        def closing(*args, async_stager=None, **kwargs):  # what torch 2.11 does
            response = dcp.async_save(*args, async_stager=async_stager, **kwargs)
            if async_stager is not None:
                async_stager._state_dict_stager.close()  # at the end of every stage
                async_stager.close()
            return response

        if __name__ == "__main__":
            saver.dcp = type("dcp", (), {{"async_save": staticmethod(closing),
                                          "save": dcp.save, "load": dcp.load}})
            train(load_job({str(job)!r}, []), quiet=True)
        """)
    script = tmp_path / "closing.py"
    script.write_text(code)
    env = {"PATH": "/usr/bin:/bin", "OPTIMUS_RANK": "0", "OPTIMUS_WORLD_SIZE": "1",
           # what this interpreter sees beside the repo (the GPU image's carried wheels)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    committed = committed_steps(tmp_path / "ckpt")
    if committed != [2, 4, 6, 8]:  # a failed save leaves a gap: say what each save said
        saves = [line for path in tmp_path.rglob("metrics.jsonl")
                 for line in path.read_text().splitlines() if '"checkpoint"' in line]
        pytest.fail(f"committed {committed}, not [2, 4, 6, 8]: {saves}\n{done.stderr[-3000:]}")


def test_the_stager_stages_again_after_torch_closes_it_and_its_inner_stager():
    """torch 2.11's async_save closes the stager it is given after every save, and its
    DefaultStager closes the inner StateDictStager, emptying its copy table: the next stage of a
    state holding a class object raised `KeyError: <class 'type'>` on an H200
    (bench/checkpoint.py's process-mode saves)."""
    from optimus.checkpoint.staging import Stager

    stager = Stager(shared=True)
    try:
        state = {"weight": torch.arange(6.0), "kind": torch.float32.__class__, "step": 3}
        first = stager.stage(state).result()
        stager.close()  # what 2.11's async_save does after a save
        stager._state_dict_stager.close()  # and its `_stage`
        state["weight"] += 1
        second = stager.stage(state).result()
        assert second["kind"] is state["kind"] and second["step"] == 3
        assert torch.equal(second["weight"], torch.arange(6.0) + 1)
        # the shared buffer of the first stage is reused, not dropped
        assert second["weight"].untyped_storage().data_ptr() == \
            first["weight"].untyped_storage().data_ptr()
    finally:
        stager.release()
    assert not stager._state_dict_stager._deepcopy_dispatch  # released: freed for real


def test_the_pipeline_hands_torch_contiguous_microbatches():
    """Tokens and labels are views of one [batch, seq + 1] tensor; torch 2.11's stages check
    each microbatch's strides against a contiguous one's and refuse the views."""
    from optimus.parallel.pipeline import run_pipeline_step

    seen = {}

    class Schedule:
        def step(self, *args, target=None, losses=None, return_outputs=True):
            seen["args"], seen["target"] = args, target

    batch = torch.arange(4 * 17).view(4, 17)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    assert not inputs.is_contiguous()
    run_pipeline_step(Schedule(), [0, 1], 2, inputs, labels)
    assert seen["args"][0].is_contiguous() and seen["target"].is_contiguous()
    assert torch.equal(seen["args"][0], inputs) and torch.equal(seen["target"], labels)


def test_rowwise_float8_on_a_cpu_without_per_row_scales_is_refused_by_name(monkeypatch):
    """torch 2.11's CPU `_scaled_mm` asserts on per-row scales: the refusal names the recipe
    and the fix, before any rank starts."""
    from optimus.parallel import float8

    def per_tensor_only(a, b, *, scale_a, scale_b, **kwargs):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend")
        return torch.zeros(a.shape[0], b.shape[1])

    float8.cpu_rowwise_problem.cache_clear()
    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    try:
        problem = float8.float8_problem("cpu", recipe="rowwise")
        assert problem and "per-tensor scales only" in problem and "tensorwise" in problem
        assert float8.float8_problem("cpu", recipe="tensorwise") is None
    finally:
        float8.cpu_rowwise_problem.cache_clear()


def test_every_torch_name_gpu_check_tries_is_in_the_pinned_torch():
    """bench/gpu_check.py names a part unrunnable when its torch lacks one of these: the pinned
    torch has them all, so a line it prints is news about that machine's torch."""
    sys.path.insert(0, str(ROOT))
    from bench.gpu_check import NAMES, missing_names

    assert len(NAMES) >= 10 and missing_names() == {}


def test_gpu_check_s_quorum_group_probe_runs_its_path_on_the_host():
    """The probe a GPU machine runs on NCCL (bench/gpu_check.py `probe_quorum_group`), here on
    gloo: the same group, exchange and figures; it names what is wrong when a figure is."""
    from bench.gpu_check import probe_quorum_group

    assert probe_quorum_group("gloo", "cpu") is None
    assert "no quorum group on backend 'mpi'" in probe_quorum_group("mpi", "cpu")


def test_gpu_check_without_a_gpu_names_every_part_and_writes_what_gpu_sh_reads(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_check.py", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for part in ("mfu", "moe", "checkpoint", "planner_memory"):
        assert f"cannot run: {part}: torch {torch.__version__} sees no CUDA device" in lines
    assert lines[-1] == "runs: nothing"
    assert (tmp_path / "skip_parts.txt").read_text().split() == [
        "mfu", "moe", "checkpoint", "planner_memory"]
    assert (tmp_path / "mfu_modes.txt").read_text().strip() == ""
    assert json.loads((tmp_path / "check.json").read_text())["cannot"]


@pytest.mark.parametrize("weights", [[0.6, 0.3, 0.1], [0.7, 0.2, 0.1], [0.45, 0.35, 0.2]])
def test_mixture_quotas_do_not_depend_on_how_floats_are_summed(weights):
    """Python 3.12 (the GPU image's) sums floats with compensation, 3.11 left to right: the
    weights' total, and once a slot, differed. Quotas are exact, so any order gives the same
    slots to the same weights."""
    from itertools import permutations

    from optimus.data.mixture import BLOCK, quotas

    want = dict(zip(weights, quotas(weights), strict=True))
    assert sum(want.values()) == BLOCK
    for order in permutations(weights):
        assert dict(zip(order, quotas(list(order)), strict=True)) == want, order


# Private names the checkpoint reader relies on (optimus/checkpoint/safe_pickle.py, storage.py):
# DCP's index pickles them, and torch 2.11 writes and reads them as 2.13 does.
CHECKPOINT_PRIVATE_NAMES = [
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),  # only as a name DCP's pickles hold
]


@pytest.mark.parametrize("module,name", CHECKPOINT_PRIVATE_NAMES)
def test_every_private_name_the_checkpoint_reader_allows_is_in_this_torch(module, name):
    """A DCP index names these; the restricted unpickler maps each to what it was."""
    import importlib

    from optimus.checkpoint.safe_pickle import _ALLOWED

    assert hasattr(importlib.import_module(module), name)
    assert (module, name) in _ALLOWED
