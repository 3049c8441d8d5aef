"""Pipeline parallelism: split the GPT into stages and run them with torch's schedules.

Built on `torch.distributed.pipelining` (PipelineStage + the Schedule* classes) as it is in
torch 2.13; nothing of it is rewritten here. What this module adds:

- `build_stage_models`: a stage is the plain GPT with the layers outside its range deleted
  (keys keep their numbers), the embedding only on the first stage and the final norm and
  head only on the last. Built on meta and initialised by name, so every layout starts from
  the weights one process would have.
- `build_schedule`: one PipelineStage per local stage, shapes inferred by torch at the first
  step (tokens int64 [mb, seq] into the first stage, hidden states [mb, seq, dim] between
  stages; MoE layers do not count that pass, see `_Stage`), and the named schedule with
  `scale_grads=False`.
- `run_pipeline_step`: the one call every rank makes, whatever stages it holds.

Where torch falls short (2.13): the zero-bubble schedules (SPLIT_BACKWARD) compute weight
gradients in a separate pass from `submod.parameters()`, collected before the input backward.
Under FSDP2 with reshard_after_forward (its default for non-root modules) those are the
sharded parameters, not the unsharded ones in the autograd graph, so weight gradients come out
missing or wrong, silently (seen with pp=2 x dp=2 on gloo). `build_schedule` therefore turns
resharding after forward off for those schedules: stage parameters stay unsharded from a
forward to its backward, as torchtitan does for every pipeline schedule.

Mixed precision without FSDP2 (dp 1, bf16): torch's schedules call the stage's module for every
forward (and once for the shape inference), so each stage module is handed to them inside
`_Autocast`, whose forward runs the stage under autocast; backward runs outside it, in the
dtypes the forward recorded. Parameter names are those of the stage models, which `parts` keeps.

Gradient scaling: the trainer's loss_fn divides by the global token count, so each
microbatch's loss is already its share of the step's loss. torch's schedules would otherwise
divide every gradient by n_microbatches once more (scale_grads=True, their default).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from optimus.config.schedule_rules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    is_multi_stage,
    stage_layers,
)
from optimus.models import GPT, materialize
from optimus.parallel.data_parallel import compute


def build_stage_models(cfg, seed: int, device: torch.device | str, stage_ids: list[int],
                       num_stages: int) -> list[nn.Module]:
    """One GPT per stage id: only that stage's layers, initialised exactly as in one process.

    The first stage keeps `tok_embeddings`; the last keeps `norm` and `output`; layers are
    split by `stage_layers` (contiguous, earlier stages take the extra ones).
    """
    ranges = stage_layers(cfg.n_layers, num_stages)
    models = []
    for stage_id in stage_ids:
        if not 0 <= stage_id < num_stages:
            raise ValueError(f"stage {stage_id} does not exist in a {num_stages}-stage pipeline")
        with torch.device("meta"):
            model = GPT(cfg)
        keep = {str(i) for i in ranges[stage_id]}
        for key in [k for k in model.layers if k not in keep]:
            del model.layers[key]
        if stage_id != 0:
            model.tok_embeddings = None
        if stage_id != num_stages - 1:
            model.norm = None
            model.output = None
        models.append(materialize(model, seed, device))
    return models


def build_schedule(stage_models: list[nn.Module], stage_ids: list[int], num_stages: int,
                   group: ProcessGroup | DeviceMesh, device: torch.device | str,
                   schedule: str, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   autocast: torch.dtype | None = None):
    """The named torch schedule over this rank's stages, `n_microbatches=microbatches`, its
    stages talking over `group` (the pipeline's process group, or its one-dimensional mesh).

    `stage_models` may already be tensor-parallel (DTensor parameters) and FSDP2-wrapped
    (`fully_shard` applied to each stage model as root): the schedules recognise a root
    FSDPModule and reduce its gradients themselves once per step (see `run_pipeline_step`).
    `loss_fn(logits [mb, seq, vocab], labels [mb, seq])` runs on the last stage's rank.
    `autocast`: the dtype each stage's forward autocasts to (dp 1 in bf16), or None.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose among {sorted(SCHEDULES)}")
    if len(stage_models) != len(stage_ids):
        raise ValueError(f"{len(stage_models)} stage models for {len(stage_ids)} stage ids")
    if schedule in SPLIT_BACKWARD:
        for model in stage_models:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_reshard_after_forward(False, recurse=False)
    # Imported here, not at the top: torch's pipelining imports dynamo (~0.6 s of CPU), which
    # a rank without a pipeline never needs.
    import torch.distributed.pipelining as pipelining

    from optimus.parallel.pipeline_stage import Stage

    group = group.get_group() if isinstance(group, DeviceMesh) else group
    device = torch.device(device)
    order = sorted(range(len(stage_ids)), key=stage_ids.__getitem__)  # ascending, as torch wants
    modules = [m if autocast is None else _Autocast(m, autocast) for m in stage_models]
    stages = [Stage(modules[i], stage_ids[i], num_stages, device, group=group) for i in order]
    cls = getattr(pipelining, SCHEDULES[schedule])
    if not is_multi_stage(schedule):
        if len(stages) != 1:
            raise ValueError(f"{schedule} runs one stage per rank, this rank has {len(stages)}")
        stages = stages[0]
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


class _Autocast(nn.Module):
    """A stage model whose forward runs under autocast to `dtype` (`compute`)."""

    def __init__(self, stage: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.stage, self.dtype = stage, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with compute(x.device, self.dtype):
            return self.stage(x)


def run_pipeline_step(schedule, stage_ids: list[int], num_stages: int,
                      inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Run forward and backward over all microbatches; return this rank's microbatch losses.

    Every rank of the pipeline calls this with its replica's whole step batch (`inputs` and
    `labels` [microbatches * mb, seq]); torch splits it along dim 0. The rule torch needs:
    the tokens go to `step` only on the rank holding stage 0 (which must have real tensors),
    the labels and a losses list only on the rank holding the last stage (V-style schedules
    put both on pp rank 0). Elsewhere step() takes neither.

    Returns one detached loss per microbatch on the rank holding the last stage (their sum is
    the step's loss, given a loss_fn normalised by the global token count), else [].
    Gradients accumulate into `.grad`: zero them before, as without a pipeline. FSDP2 stage
    models are reduce-scattered by the schedule at the end of the step.
    """
    # Contiguous: tokens and labels are views of one [.., seq + 1] batch, and torch 2.11's
    # stages check each microbatch's strides against those of a contiguous one.
    args = (inputs.contiguous(),) if 0 in stage_ids else ()
    if num_stages - 1 in stage_ids:
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=labels.contiguous(), losses=losses, return_outputs=False)
        return [loss.detach() for loss in losses]
    schedule.step(*args, return_outputs=False)
    return []



def forward_stages(parts: list[nn.Module], stage_ids: list[int], owners: list[int],
                   group: ProcessGroup, inputs: list[torch.Tensor],
                   loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Forward only, without torch's schedules (validation): every microbatch through the
    stages this rank holds, in ascending stage order, hidden states passed point to point.

    `owners[s]` is the rank of the pipeline's `group` holding stage s; `inputs` are the
    microbatches' tokens, used by the rank holding stage 0; `loss_fn(microbatch index,
    logits)` runs on the rank holding the last stage, whose losses are returned (elsewhere
    []). Why not `schedule.eval`: in torch 2.13 it fails for the zero-bubble schedules (their
    action lists keep backward actions), and every switch between it and training re-runs the
    stages' shape inference. Dependencies only point to higher stages and sends do not block,
    so ascending order cannot deadlock. Hidden states travel in float32 (under FSDP2 the next
    stage's root casts them back to its compute dtype; under autocast, dp 1, the residual
    stream is float32 anyway), after their shape (under sequence parallelism each tp rank's
    share of the sequence). The caller enters autocast.
    """
    group_ranks = dist.get_process_group_ranks(group)
    last = len(owners) - 1
    local = {}  # (stage, microbatch) -> hidden states from a stage this rank also holds
    losses = []
    sends = []  # in flight, with their tensors: a blocking send could wait on a rank that is
    # itself sending to us (stages 0 and 2 here, 1 and 3 there)
    for stage, part in sorted(zip(stage_ids, parts, strict=True), key=lambda x: x[0]):
        for i, tokens in enumerate(inputs):
            if stage == 0:
                x = tokens
            elif owners[stage - 1] == owners[stage]:
                x = local.pop((stage, i))
            else:
                src = group_ranks[owners[stage - 1]]
                shape = torch.empty(3, dtype=torch.int64, device=tokens.device)
                dist.recv(shape, src, group=group)
                x = torch.empty(shape.tolist(), device=tokens.device)
                dist.recv(x, src, group=group)
            out = part(x)
            if stage == last:
                losses.append(loss_fn(i, out))
            elif owners[stage + 1] == owners[stage]:
                local[(stage + 1, i)] = out
            else:
                dst = group_ranks[owners[stage + 1]]
                for t in (torch.tensor(out.shape, device=out.device), out.float().contiguous()):
                    sends.append((dist.isend(t, dst, group=group), t))
    for work, _ in sends:
        work.wait()
    return losses
