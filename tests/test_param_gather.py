"""`parallel.param_gather: step` trains exactly like the default and gathers once a step.

Four gloo ranks run two optimizer steps of 4 microbatches under FSDP2 (dp 4, and pp 2 x dp 2
with 1F1B), once with the default (parameters re-gathered for every microbatch's forward and
backward) and once with the parameters kept gathered through the step. The losses and the
trained shards must be equal, the all-gathers of a step counted by `Collectives` must fall
from two per unit per microbatch (m + 1 per unit under a pipeline) to one per unit, and the
kept parameters must show in the measured peak memory (without a pipeline). The planner
prices the gathers with the same counts (optimus/planner/steptime.py).
"""

from __future__ import annotations

import pytest
import torch

from optimus.config import validate_job

WORLD, SEQ, MICROBATCHES, STEPS = 4, 32, 4, 2
MODEL = {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4, "ffn_dim": 128,
         "max_seq_len": SEQ}
LAYOUTS = {"dp4": {}, "pp2 x dp2 1f1b": {"pp": 2}}  # 5 units (4 blocks, root); 3 a stage


def _raw(parallel: dict, microbatches: int) -> dict:
    return {"name": "gather", "model": MODEL, "optim": {"steps": STEPS, "warmup_steps": 0},
            "data": {"seq_len": SEQ, "batch_size": 4 * microbatches,
                     "microbatches": microbatches},
            "parallel": {"device": "cpu", **parallel}}


def _run(rank: int, world: int, parallel: dict, microbatches: int = MICROBATCHES) -> dict:
    """Losses, collective counts and peak bytes of each step, the units and trained shards."""
    from torch.distributed.fsdp import FSDPModule

    from optimus.config import resolve_layout
    from optimus.optim import build_optimizer
    from optimus.parallel.plan import build_parallel_model
    from optimus.planner.measure import Collectives, PeakMemory, state_tensors

    cpu = torch.device("cpu")
    job = validate_job(_raw(parallel, microbatches), world=world)
    mesh = resolve_layout(job, world).build_mesh("cpu")
    parts = build_parallel_model(job, mesh, cpu)
    optimizer = build_optimizer(parts.state_view(), job.optim, cpu)
    out = {"losses": [], "counts": [], "peaks": [],
           "units": sum(isinstance(m, FSDPModule) for p in parts.parts for m in p.modules())}
    for step in range(STEPS):
        batch = torch.randint(0, 256, (4 * microbatches, SEQ + 1),
                              generator=torch.Generator().manual_seed(step))
        mine = batch.chunk(mesh.size("batch"))[mesh.rank("batch")]
        pieces = [{"input_ids": x[:, :-1], "labels": x[:, 1:]}
                  for x in mine.chunk(microbatches)]
        parts.set_step_tokens(batch[:, 1:].numel())
        memory, comms = PeakMemory(), Collectives()
        memory.track(state_tensors(parts.parts, optimizer))
        with memory, comms:
            loss = parts.forward_backward(pieces, cpu)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.distributed.all_reduce(loss)
        out["losses"].append(float(loss))
        out["counts"].append(comms.counts)
        out["peaks"].append(memory.peak)
    out["state"] = {k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                    for k, v in parts.state_view().state_dict().items()}
    return out


@pytest.fixture(scope="module")
def runs():
    from tests.multiproc import run_ranks

    return {(name, gather): run_ranks(_run, WORLD, {**parallel, "param_gather": gather},
                                      timeout=120)
            for name, parallel in LAYOUTS.items() for gather in ("microbatch", "step")}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_same_training_one_gather_per_unit_per_step_more_memory(runs, name):
    every, kept = runs[(name, "microbatch")], runs[(name, "step")]
    for default, gathered in zip(every, kept, strict=True):
        assert gathered["losses"] == pytest.approx(default["losses"], rel=1e-6)
        for key, value in default["state"].items():
            torch.testing.assert_close(gathered["state"][key], value, rtol=1e-6, atol=1e-7)
        units = gathered["units"]
        # the last step: the first step of a pipeline also runs torch's shape inference
        assert gathered["counts"][-1]["allgather"] == units
        # the default: every unit gathered for each microbatch's forward and again for its
        # backward; under a pipeline torch's stages keep the units gathered from a backward
        # to the next forward, so the backward gathers once a step (the planner's law)
        per_unit = MICROBATCHES + 1 if "pp" in LAYOUTS[name] else 2 * MICROBATCHES
        assert default["counts"][-1]["allgather"] == per_unit * units
        # the reduce-scatters stay one per unit per step
        assert gathered["counts"][-1]["reduce_scatter"] == units
        assert default["counts"][-1]["reduce_scatter"] == units
        if "pp" in LAYOUTS[name]:
            # the default pipeline already holds the units gathered through its backwards:
            # keeping them costs next to no memory there
            assert gathered["peaks"][-1] == pytest.approx(default["peaks"][-1], rel=0.1)
        else:  # every unit gathered at once, where the default held the running two
            assert gathered["peaks"][-1] > default["peaks"][-1]
