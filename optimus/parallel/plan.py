"""Build this rank's share of the model for a layout, and run one step's forward and backward.

Plans are applied in one fixed order: pipeline split, then per stage float8 conversion (the
linears, `training.float8`; the experts' grouped GEMMs, `training.float8_experts`) -> tensor
parallel -> context parallel -> expert parallel -> activation checkpointing -> compile ->
data-parallel sharding and mixed precision (FSDP2 over dp x cp, experts over their `edp`), all
on the meta device;
only then are this rank's shards allocated and initialised. At dp 1 nothing is sharded and
FSDP2 is not applied: bf16 is autocast around every forward instead (`compute`,
optimus/parallel/data_parallel.py says why). Under context parallelism each rank's
microbatches are cut to its slice of every sequence as they enter (`take_microbatches`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from optimus.config import JobConfig
from optimus.config.schedule_rules import stage_ids as pipeline_stage_ids
from optimus.config.schedule_rules import stage_style
from optimus.models import build_model, materialize
from optimus.models.moe import MoE, moe_layers
from optimus.parallel.activation_checkpoint import apply_activation_checkpointing
from optimus.parallel.compile import apply_compile
from optimus.parallel.context_parallel import (
    SequenceSlice,
    apply_context_parallel,
    take_microbatches,
)
from optimus.parallel.data_parallel import (
    apply_data_parallel,
    autocast_dtype,
    compute,
    precision_policy,
    set_gradient_sync,
)
from optimus.parallel.expert_parallel import apply_expert_parallel
from optimus.parallel.experts import share_balance_counts
from optimus.parallel.float8 import apply_float8
from optimus.parallel.float8_experts import apply_float8_experts
from optimus.parallel.loss import (  # noqa: F401 (the first two are re-exported)
    IGNORE_INDEX,
    TokenSumLoss,
    cross_entropy_sum,
)
from optimus.parallel.pipeline import (
    build_schedule,
    build_stage_models,
    forward_stages,
    run_pipeline_step,
)
from optimus.parallel.tensor_parallel import (
    apply_tensor_parallel,
    loss_context,
    sum_grads_over_tp,
)
from optimus.runtime.device import compute_dtype
from optimus.runtime.mesh import LayoutMesh
from optimus.supervision.heartbeat import NO_HEARTBEAT, Heartbeat, NoHeartbeat


@dataclass
class ParallelModel:
    """The model chunks this rank holds, and the pipeline schedule that drives them, if any."""

    parts: list[nn.Module]
    schedule: object | None
    stage_ids: list[int]
    num_stages: int
    loss_fn: TokenSumLoss
    tp_enabled: bool
    moe: list[MoE] = field(default_factory=list)  # the MoE layers of these chunks
    # Under tensor parallelism: the MoE layers train on each tp rank's own tokens.
    tensor_group: dist.ProcessGroup | None = None
    # training.float8: the matmul layers of these chunks left in high precision, and why.
    float8_skipped: list[tuple[str, str]] = field(default_factory=list)
    # Under a pipeline: the pipeline rank holding each stage, and the pipeline's group
    # (validation's forward).
    stage_owners: list[int] = field(default_factory=list)
    pipeline_group: dist.ProcessGroup | None = None
    # parallel.param_gather: step: parameters stay gathered between microbatches.
    keep_gathered: bool = False
    # dp 1 in bf16: the dtype every forward autocasts to (FSDP2's policy casts at dp > 1).
    autocast: torch.dtype | None = None
    # Under context parallelism: the positions of every sequence this rank holds.
    context: SequenceSlice | None = None

    def set_step_tokens(self, tokens: int) -> None:
        """The step's global token count: the loss and any auxiliary loss divide by it."""
        self.loss_fn.tokens = tokens
        for layer in self.moe:
            layer.step_tokens = tokens

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.parts:
            yield from part.parameters()

    def state_view(self) -> nn.Module:
        """One module over every chunk this rank holds, named as in the whole model.

        The optimizer is built on it, and checkpoints read it.

        Its state_dict keys (`layers.5.attention.wq.weight`, `output.weight`) are the same in
        every layout, which is what lets a checkpoint saved under one layout load in another.
        """
        if len(self.parts) == 1:
            return self.parts[0]
        view = nn.Module()
        view.layers = nn.ModuleDict()
        for part in self.parts:
            for name, child in part.named_children():
                if name == "layers":
                    view.layers.update(child)
                elif child is not None:
                    view.add_module(name, child)
        return view

    def forward_backward(self, microbatches: list[dict], device: torch.device,
                         heartbeat: Heartbeat | NoHeartbeat = NO_HEARTBEAT) -> torch.Tensor:
        """Run every microbatch forward and backward; return this rank's summed loss.

        The loss is already divided by the step's global token count. Under a pipeline only
        ranks holding the last stage see losses; the others return zero. `heartbeat` is told
        the phase, "forward" or "backward".
        """
        total = None
        microbatches = take_microbatches(microbatches, self.context)
        with loss_context(self.tp_enabled):
            if self.schedule is not None:
                total = torch.zeros((), device=device)  # a stage without losses: zero
                inputs = torch.cat([mb["input_ids"] for mb in microbatches]).to(device)
                labels = torch.cat([mb["labels"] for mb in microbatches]).to(device)
                # The schedule interleaves forward and backward: all of it counts as "forward".
                # Its stages autocast their own forwards (`build_schedule`).
                with heartbeat.phase("forward"):
                    losses = run_pipeline_step(self.schedule, self.stage_ids, self.num_stages,
                                               inputs, labels)
                for loss in losses:
                    total += _local(loss.detach())
            else:
                (model,) = self.parts
                for i, mb in enumerate(microbatches):
                    set_gradient_sync(model, i == len(microbatches) - 1, self.keep_gathered)
                    with heartbeat.phase("forward"), compute(device, self.autocast):
                        logits = model(mb["input_ids"].to(device, non_blocking=True))
                        loss = self.loss_fn(logits, mb["labels"].to(device, non_blocking=True))
                    with heartbeat.phase("backward"):
                        loss.backward()
                    value = _local(loss.detach())  # the graph is gone: its storage is free
                    total = value if total is None else total.add_(value)
        if self.tensor_group is not None and self.moe:
            with heartbeat.phase("backward"):
                sum_grads_over_tp([p for m in self.moe for p in m.parameters()],
                                  self.tensor_group)
        return total


    @torch.no_grad()
    def forward_loss(self, microbatches: list[dict], device: torch.device) -> torch.Tensor:
        """Forward only (validation): this rank's summed cross-entropy of the microbatches'
        labelled tokens, not divided by anything. Under a pipeline only ranks holding the last
        stage see losses (the others return zero); nothing is counted as training load."""
        total = torch.zeros((), device=device)
        microbatches = take_microbatches(microbatches, self.context)
        tokens, self.loss_fn.tokens = self.loss_fn.tokens, 1  # the step's divisor, put back
        try:
            with loss_context(self.tp_enabled), compute(device, self.autocast):
                if self.schedule is not None:
                    labels = [mb["labels"].to(device) for mb in microbatches]
                    losses = forward_stages(
                        self.parts, self.stage_ids, self.stage_owners, self.pipeline_group,
                        [mb["input_ids"].to(device) for mb in microbatches],
                        lambda i, logits: self.loss_fn(logits, labels[i]))
                    for loss in losses:
                        total += _local(loss)
                else:
                    (model,) = self.parts
                    for mb in microbatches:
                        logits = model(mb["input_ids"].to(device, non_blocking=True))
                        total += _local(self.loss_fn(logits, mb["labels"].to(device)))
        finally:
            self.loss_fn.tokens = tokens
        return total


def _fsdp_mesh(mesh: LayoutMesh, purpose: str):
    """What FSDP2 shards a purpose's weights over: its mesh, or with several replicas the
    (replicas, purpose) mesh, HSDP: sharded inside a replica, replicated across them."""
    if mesh.size("replicas") == 1:
        return mesh.mesh(purpose)
    return mesh.mesh_of("replicas", purpose)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def build_parallel_model(job: JobConfig, mesh: LayoutMesh,
                         device: torch.device) -> ParallelModel:
    """This rank's model chunks, with the same weights as the one-process model, on the layout
    `mesh` was built from."""
    p, layout = job.parallel, mesh.dims
    # The vocab-parallel loss (tp > 1) stays eager: its DTensor backward does not compile.
    loss_fn = TokenSumLoss(job.training.compile_backend
                           if job.training.compile and mesh.size("tensor") == 1 else None,
                           z_loss=job.optim.z_loss)
    if layout.pp > 1:
        num_stages = layout.stages
        ids = pipeline_stage_ids(mesh.rank("pipeline"), layout.pp, layout.virtual_stages,
                                 stage_style(p.schedule))
        parts = build_stage_models(job.model, job.seed, "meta", ids, num_stages)
    else:
        num_stages, ids = 1, [0]
        parts = [build_model(job.model, seed=job.seed, device="meta")]
    sharded, tensor, experts, context, replicated = (
        mesh.size(s) > 1 for s in ("shard", "tensor", "experts", "context", "replicas"))
    wrapped = sharded or replicated  # FSDP2 wraps the model: sharded, or HSDP's replicas
    experts_group = mesh.own_group("experts") if experts else None
    where = context_group = None
    if context:
        where = SequenceSlice(mesh.rank("context"), layout.cp, p.cp_split == "balanced")
        context_group = mesh.own_group("context")
    # bf16 is FSDP2's mixed-precision policy under data parallelism, autocast without it.
    dtype = compute_dtype(job.training.mixed_precision, device)
    policy = precision_policy(dtype) if wrapped else None
    autocast = autocast_dtype(dtype, mesh.size("shard") * mesh.size("replicas"))
    recipe, float8_skipped = job.training.float8, []
    keep_gathered = p.param_gather == "step" and wrapped
    for part in parts:
        if recipe != "off":  # first: TP and FSDP2 then wrap the Float8Linear layers
            float8_skipped += apply_float8(
                part, recipe, fsdp_float8_all_gather=recipe == "tensorwise" and wrapped,
                min_dim=job.training.float8_min_dim)
        if job.training.float8_experts != "off":  # their `matmul`: EP and FSDP2 keep it
            apply_float8_experts(part, job.training.float8_experts)
        if tensor:
            apply_tensor_parallel(part, mesh.mesh("tensor"))
        if context:
            apply_context_parallel(part, context_group, p.cp_method, where, job.data.seq_len)
        if experts:
            apply_expert_parallel(part, mesh.mesh("experts"), experts_group)
        apply_activation_checkpointing(part, p.activation_checkpoint, p.ac_every)
        if job.training.compile:
            apply_compile(part, job.training.compile_backend)
        if wrapped:  # under HSDP each mesh is (replicas, its shard)
            apply_data_parallel(part, _fsdp_mesh(mesh, "shard"),
                                _fsdp_mesh(mesh, "expert_shard") if experts else None,
                                policy, keep_gathered=keep_gathered)
        # Only now, sharded, is the model allocated: each rank holds its shards, never the
        # whole model (init_weights gives every shard its part of the one-process values).
        materialize(part, job.seed, device)
    moe = [m for part in parts for m in moe_layers(part)]
    share_balance_counts(moe, job.model, mesh)
    schedule, owners, pipeline = None, [], None
    if layout.pp > 1:
        pipeline = mesh.group("pipeline")
        schedule = build_schedule(parts, ids, num_stages, pipeline, device, p.schedule,
                                  job.data.microbatches, loss_fn, autocast)
        style = stage_style(p.schedule)
        held = [pipeline_stage_ids(r, layout.pp, layout.virtual_stages, style)
                for r in range(layout.pp)]
        owners = [next(r for r in range(layout.pp) if s in held[r]) for s in range(num_stages)]
    return ParallelModel(parts, schedule, ids, num_stages, loss_fn, tensor, moe,
                         mesh.group("tensor") if tensor else None, float8_skipped,
                         owners, pipeline_group=pipeline, keep_gathered=keep_gathered,
                         autocast=autocast, context=where)
