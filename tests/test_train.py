"""The trainer: it learns, data parallel equals one process, and its numbers are right."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from optimus.config import OptimConfig, validate_job
from optimus.metrics import MetricsLog, peak_flops
from optimus.models import build_model, flops_per_token
from optimus.optim import build_optimizer, lr_at
from optimus.train import train

REPO = Path(__file__).resolve().parents[1]


def tiny(run_dir: str = "runs/test", **sections) -> dict:
    raw = {"name": "tiny-test", "run_dir": run_dir,
           "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                     "max_seq_len": 64},
           "optim": {"steps": 5, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
           "data": {"seq_len": 32, "batch_size": 8, "microbatches": 2},
           "parallel": {"device": "cpu"}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _train_on_ranks(rank: int, world_size: int, raw: dict) -> dict:
    result = train(validate_job(raw, world=world_size), keep_state=True, keep_sample_ids=True,
                   quiet=True)
    return {"losses": result.losses, "state": result.state, "samples": result.sample_ids,
            "grad_norms": [m.grad_norm for m in result.metrics]}


def test_loss_falls_on_the_synthetic_corpus(tmp_path):
    job = validate_job(tiny(str(tmp_path), optim={"steps": 60, "warmup_steps": 5}), world=1)
    losses = train(job, quiet=True).losses
    assert len(losses) == 60
    assert losses[0] > math.log(257) - 0.5  # starts near chance
    assert sum(losses[-5:]) / 5 < 2.5  # and has learned the corpus' structure


def test_two_data_parallel_ranks_match_one_process(run_ranks, tmp_path):
    raw = tiny(str(tmp_path))
    (one,) = run_ranks(_train_on_ranks, 1, raw, timeout=120)
    two = run_ranks(_train_on_ranks, 2, raw, timeout=120)
    for rank in two:
        assert rank["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert rank["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
        assert rank["state"].keys() == one["state"].keys()
        for name, value in one["state"].items():
            # Norm-wise, not element-wise: Adam divides each update by its own gradient's
            # scale, so a weight with a near-zero gradient moves by rounding noise times lr
            # (tests/test_parallel_matrix.py says more); the tensor as a whole agrees to 1e-7.
            error = (rank["state"][name] - value).norm() / value.norm()
            assert error < 1e-5, f"{name}: relative error {error:.2e}"
    # the weights really moved, so agreeing is not trivial
    start = build_model(validate_job(raw).model, seed=1234, device="cpu").state_dict()
    assert not torch.equal(start["layers.0.attention.wq.weight"],
                           one["state"]["layers.0.attention.wq.weight"])
    # together the two ranks read exactly the samples the single process read, step by step
    for step, samples in enumerate(one["samples"]):
        assert sorted(two[0]["samples"][step] + two[1]["samples"][step]) == sorted(samples)
        assert not set(two[0]["samples"][step]) & set(two[1]["samples"][step])


def test_gradient_accumulation_equals_one_large_microbatch(tmp_path):
    results = []
    for microbatches in (1, 4):
        job = validate_job(tiny(str(tmp_path), data={"microbatches": microbatches}), world=1)
        results.append(train(job, keep_state=True, quiet=True))
    one, four = results
    assert four.losses == pytest.approx(one.losses, rel=1e-5)
    # Summing in another order changes gradients by rounding only; Adam divides each
    # element by its own scale, which can lift that to ~1e-6 on a weight near zero.
    for name, value in one.state.items():
        torch.testing.assert_close(four.state[name], value, rtol=1e-5, atol=1e-5)


def test_learning_rate_schedule():
    cfg = OptimConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(1, cfg) == pytest.approx(0.1)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(500, cfg) == pytest.approx(0.1)


def test_weight_decay_skips_norm_weights():
    job = validate_job(tiny())
    model = build_model(job.model, seed=0, device="cpu")
    decayed, plain = build_optimizer(model, job.optim, torch.device("cpu")).param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"])
    assert len(plain["params"]) == 2 * job.model.n_layers + 1  # two norms a block + final
    assert decayed["fused"] and plain["fused"]


def test_peak_table_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Intel(R) Data Center GPU Max 1550") == 298e12
    assert peak_flops("cpu") is None
    assert peak_flops("cpu", override_tflops=2.0) == 2e12
    log = MetricsLog(None, total_steps=1, flops_per_token=1_000_000,
                     peak_flops_per_device=1e12, world_size=4, enabled=False)
    tokens_per_s, mfu = log.throughput(tokens_in_step=8000, step_time_s=2.0)
    assert tokens_per_s == 4000
    assert mfu == pytest.approx(4000 * 1e6 / 4e12)


def test_metrics_file_holds_one_line_per_step(tmp_path):
    raw = tiny(str(tmp_path), supervision={"peak_tflops": 1.0})
    job = validate_job(raw, world=1)
    train(job)
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert [m["tokens"] for m in lines] == [256 * s for s in range(1, 6)]  # 8 x 32 a step
    assert lines[0]["lr"] == pytest.approx(1.5e-3)  # warmup: step 1 of 2
    per_token = flops_per_token(job.model, 32)
    for m in lines:
        assert m["tokens_per_s"] == pytest.approx(256 / m["step_time_s"], rel=1e-6)
        assert m["mfu"] == pytest.approx(per_token * m["tokens_per_s"] / 1e12, rel=1e-6)
        assert m["grad_norm"] > 0 and math.isfinite(m["loss"])


def test_a_steps_record_is_written_before_its_checkpoint_is_saved(tmp_path):
    """Step N's line (its samples' fingerprint) is on disk before a save of step N starts: a
    rank lost after that save commits but before the line would leave a checkpoint a restart
    resumes from with no record of what step N read (the data audit's hole). A synchronous
    save every 2 steps: each save step's line counts the saves before it, not its own."""
    raw = tiny(str(tmp_path), optim={"steps": 6},
               checkpoint={"interval": 2, "async_mode": "sync"})
    train(validate_job(raw, world=1))
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    started = {m["step"]: m["checkpoint"]["saves_started"] for m in lines if "step" in m}
    assert started == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2}, started
    committed = sorted(p.name for p in (tmp_path / "checkpoints").iterdir()
                       if p.name.startswith("step_"))
    assert committed == ["step_000000002", "step_000000004", "step_000000006"]


def _write_job(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _clean_env() -> dict:
    launchers = ("OPTIMUS_", "SLURM_", "PALS_", "PMI", "OMPI_", "TORCHELASTIC_", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "MASTER_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launchers)}


def test_torchrun_with_two_processes_trains(tmp_path):
    """The command the README documents, run for real."""
    path = _write_job(tmp_path, tiny(str(tmp_path / "run"), optim={"steps": 20}))
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "optimus",
         "train", str(path)], capture_output=True, text=True, timeout=240, cwd=REPO,
        env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 20
    assert lines[-1]["loss"] < lines[0]["loss"] - 1.0


def test_kill_rank_fault_kills_the_rank_at_its_step(tmp_path):
    raw = tiny(str(tmp_path), fault_injection={"faults": [
        {"kind": "kill_rank", "rank": 0, "step": 3},
        {"kind": "kill_rank", "rank": 0, "step": 2, "generation": 1}]})
    proc = subprocess.run([sys.executable, "-m", "optimus", "train",
                           str(_write_job(tmp_path, raw))], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=_clean_env())
    assert proc.returncode == -signal.SIGKILL
    assert "rank 0 kills itself at step 3" in proc.stderr
    steps = [json.loads(s)["step"] for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_a_checkpoint_holds_tensors_and_plain_values_only(tmp_path):
    """Every non-tensor entry of a saved checkpoint loads under torch's weights_only unpickler:
    no object of ours is pickled into it (the RNG's layout was once a `Layout` dataclass, which
    torch 2.11's async stager could not even copy)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    raw = tiny(str(tmp_path), optim={"steps": 2},
               checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 2})
    train(validate_job(raw, world=1), quiet=True)
    folder = next((tmp_path / "ckpt").glob("step_*"))
    reader = FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    plain = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            info = metadata.storage_data[MetadataIndex(fqn)]
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = io.BytesIO(f.read(info.length))
            plain[fqn] = torch.load(data, weights_only=True)
    assert plain["rng.layout"] == "cpu:dp1.tp1.pp1.ep1.vs1"
    assert plain["optim.param_groups.tok_embeddings.weight.betas"] == (0.9, 0.95)
