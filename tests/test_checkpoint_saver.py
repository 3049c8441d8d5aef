"""Checkpoints on real gloo ranks: bitwise round trips and resharding (the commit protocol:
tests/test_checkpoint_commit.py).

Tiny models (dim 32, 4 layers) trained a few manual steps on data that is a pure function of
the global sample index, so every layout sees the same global batches.
"""

from __future__ import annotations

import logging

import multiproc
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from optimus.checkpoint.manifest import committed_steps, is_committed, step_dir
from optimus.checkpoint.saver import Checkpointer
from optimus.checkpoint.state import Progress, layout_key, training_state
from optimus.config import resolve_layout, validate_job
from optimus.optim import build_optimizer, lr_at, set_lr
from optimus.parallel.grads import clip_grad_norm_
from optimus.parallel.plan import build_parallel_model

SEQ = 16
CPU = torch.device("cpu")

# DTensor warns at every full_tensor() of a dp x tp state that it gathers in two steps.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _job(world: int, parallel: dict):
    raw = {"name": "ckpt",
           "model": {"vocab_size": 256, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                     "ffn_dim": 64, "max_seq_len": SEQ},
           "optim": {"steps": 10, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2},
           "data": {"seq_len": SEQ, "batch_size": 8, "microbatches": 2},
           "parallel": {"device": "cpu", **parallel}}
    return validate_job(raw, world=world)


class Trainer:
    """What the trainer holds: one layout's model, optimizer, progress and checkpoint state."""

    def __init__(self, rank: int, world: int, parallel: dict):
        self.job = _job(world, parallel)
        self.layout = lay = resolve_layout(self.job, world)
        self.mesh = lay.build_mesh("cpu")
        self.model = build_parallel_model(self.job, self.mesh, CPU)
        self.optimizer = build_optimizer(self.model.state_view(), self.job.optim, CPU)
        self.progress = Progress(self.job.data.batch_size)
        self.state = training_state(self.model, self.optimizer, self.progress, rank=rank,
                                    layout=layout_key(lay, CPU))

    def train(self, steps: int) -> None:
        data = self.job.data
        per_rank = data.batch_size // self.mesh.size("batch")
        dp_rank = self.mesh.rank("batch")
        for _ in range(steps):
            first = self.progress.data_index + dp_rank * per_rank
            samples = torch.stack([
                torch.randint(0, 256, (SEQ + 1,), generator=torch.Generator().manual_seed(g))
                for g in range(first, first + per_rank)])
            micro = per_rank // data.microbatches
            microbatches = [{"input_ids": samples[i:i + micro, :-1],
                             "labels": samples[i:i + micro, 1:]}
                            for i in range(0, per_rank, micro)]
            set_lr(self.optimizer, lr_at(self.progress.step + 1, self.job.optim))
            self.model.loss_fn.tokens = data.batch_size * SEQ
            self.model.forward_backward(microbatches, CPU)
            clip_grad_norm_(self.model.parameters(), self.job.optim.grad_clip,
                            self.mesh.size("pipeline"))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.progress.advance(data.batch_size * SEQ)

    def meta(self) -> dict:
        return {**self.progress.meta(), "layout": layout_key(self.layout, CPU)}

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's shards of weights and optimizer state, copied."""
        out = {f"model/{k}": _local(v) for k, v in self.state["model"].state_dict().items()}
        for key, value in self.state["optim"].state_dict().items():  # flattened: state.<fqn>.<k>
            if key.startswith("state."):
                out[f"optim/{key}"] = _local(value)
        return out

    def full_state(self) -> dict[str, torch.Tensor]:
        """Unsharded weights and AdamW state of the parameters this rank holds (collective)."""
        out = {f"model/{k}": _full(v) for k, v in self.state["model"].state_dict().items()}
        optim = get_optimizer_state_dict(self.state["optim"].view, self.optimizer)
        for fqn, values in optim["state"].items():
            out.update({f"optim/{fqn}/{k}": _full(v) for k, v in values.items()})
        return out


def _local(value: torch.Tensor) -> torch.Tensor:
    return (value.to_local() if isinstance(value, DTensor) else value).detach().clone()


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _assert_bitwise(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


# --- same layout: bitwise round trip and exact resume; the checkpoint other layouts load ------

def _save_at_tp2_dp2(rank: int, world: int, root: str) -> dict:
    run = Trainer(rank, world, {"tp": 2, "dp": 2})
    ckpt = Checkpointer(root, rank=rank, world_size=world, keep_last=2, mode="thread")
    run.train(2)
    torch.manual_seed(1000 + rank)  # every rank's RNG differs: a mix-up would show
    assert ckpt.save(2, run.state, run.meta()) == "started"
    after_save = torch.rand(4)  # what the RNG gives right after the save point
    assert ckpt.wait() == "committed"
    saved_local, saved_full = run.local_state(), run.full_state()
    run.train(1)
    expected_step3 = run.local_state()

    fresh = Trainer(rank, world, {"tp": 2, "dp": 2})
    torch.manual_seed(7)
    manifest = ckpt.load_latest(fresh.state)
    assert manifest["step"] == 2 and manifest["tokens"] == 2 * 8 * SEQ
    assert manifest["data_index"] == 16 and manifest["skipped"] == [] and manifest["notes"] == []
    assert (fresh.progress.step, fresh.progress.tokens, fresh.progress.data_index) == (
        2, 2 * 8 * SEQ, 16)
    assert torch.equal(torch.rand(4), after_save)
    _assert_bitwise(fresh.local_state(), saved_local)
    fresh.train(1)  # resumed training is the uninterrupted one, bit for bit
    _assert_bitwise(fresh.local_state(), expected_step3)
    ckpt.close()
    return {"full": saved_full if rank == 0 else None,
            "stats": ckpt.stats.as_dict(), "marker": is_committed(step_dir(root, 2))}


@pytest.fixture(scope="module")
def tp2_dp2_checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp2dp2"))
    results = multiproc.run_ranks(_save_at_tp2_dp2, 4, root, timeout=120)
    for result in results:
        assert result["marker"]
        assert result["stats"]["saves_committed"] == 1
        assert result["stats"]["last_commit_step"] == 2
    return root, results[0]["full"]


def test_same_layout_round_trip_is_bitwise(tp2_dp2_checkpoint):
    root, full = tp2_dp2_checkpoint
    assert committed_steps(root) == [2]
    assert {k.split("/")[-1] for k in full if k.startswith("optim/")} == {
        "exp_avg", "exp_avg_sq", "step"}


def _load_elsewhere(rank: int, world: int, root: str, parallel: dict,
                    resave_root: str | None = None) -> dict:
    run = Trainer(rank, world, parallel)
    ckpt = Checkpointer(root, rank=rank, world_size=world, keep_last=2, mode="thread")
    manifest = ckpt.load_latest(run.state)
    out = {"full": run.full_state(), "step": run.progress.step,
           "data_index": run.progress.data_index, "notes": manifest["notes"]}
    ckpt.close()
    if resave_root is not None:  # each rank saves only the stages it holds
        again = Checkpointer(resave_root, rank=rank, world_size=world, keep_last=2, mode="thread")
        assert again.save(run.progress.step, run.state, run.meta()) == "started"
        assert again.wait() == "committed"
        again.close()
    return out


LAYOUTS = {"pp2": (2, {"pp": 2}), "one-rank": (1, {}),
           "pp2-v2": (2, {"pp": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"})}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tp2_dp2_checkpoint_loads_under_another_layout(run_ranks, tp2_dp2_checkpoint, name,
                                                       tmp_path):
    root, saved = tp2_dp2_checkpoint
    world, parallel = LAYOUTS[name]
    resave = str(tmp_path / "resaved") if world > 1 else None
    results = run_ranks(_load_elsewhere, world, root, parallel, resave, timeout=120)
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        assert (result["step"], result["data_index"]) == (2, 16)
        assert len(result["notes"]) == 1 and "RNG states were saved under layout" in (
            result["notes"][0])
        merged.update(result["full"])
    _assert_bitwise(merged, saved)  # weights, exp_avg, exp_avg_sq and step: all of them
    if resave:  # what the pipeline ranks saved loads whole on one rank
        (again,) = run_ranks(_load_elsewhere, 1, resave, {}, timeout=120)
        _assert_bitwise(again["full"], saved)
