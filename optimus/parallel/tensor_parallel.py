"""Tensor parallel with sequence parallel (Megatron-SP) over the `tp` mesh axis, from outside.

The plan follows torchtitan's Llama plan, written with PyTorch's stock styles:

- `tok_embeddings`: vocab-parallel (RowwiseParallel); its output is reduce-scattered along the
  sequence, so between modules the residual stream is sequence-parallel: every rank holds a
  LOCAL tensor [b, s / tp, dim], its contiguous share of the positions (rank r holds positions
  r*s/tp .. (r+1)*s/tp - 1). The sequence length must divide by tp.
- each block: norms SequenceParallel; attention and feed-forward inputs all-gathered to the full
  sequence; wq, wk, wv, w1, w3 column-parallel (heads / hidden units split); wo and w2
  row-parallel, reduce-scattered back to [b, s / tp, dim]. With `model.qk_norm`, the per-head
  `q_norm` and `k_norm` (`_HeadNorm`) normalise each rank's own heads.
- a block whose feed-forward is a mixture of experts: the MoE layer takes the LOCAL sequence
  shard as it is and returns its output for those positions (no all-gather): each tp rank
  routes its own tokens (under expert parallelism, over its own ep group). The MoE's
  parameters stay whole, plain tensors on every tp rank; as each rank trains them on other
  tokens, `sum_grads_over_tp` adds their gradients up once per step. The auxiliary loss's
  slot counts are summed over tp with the other ranks' (`experts.share_balance_counts`).
- `norm` SequenceParallel; `output` column-parallel over the vocabulary, returning a DTensor
  [b, s, vocab] sharded on the vocab dim: no rank ever holds full-vocabulary logits. Compute
  cross-entropy on it (and call backward) inside `loss_context(True)`; the loss is a
  replicated DTensor scalar (`.full_tensor()` gives the plain value).

Gradients are DTensors. As stock DTensor leaves them, those of the SequenceParallel norm weights
are Partial (a pending sum over tp) and the embedding's is Replicate (full vocabulary) while its
weight is Shard(0); get_total_norm, clipping and AdamW (for-loop or fused) handle both, and
FSDP2 redistributes them to the parameters' layout before its reduce-scatter.

A pipeline stage is this plan minus the modules it lacks: a stage without `tok_embeddings`
takes, and a stage without `output` returns, the local sequence shard [b, s / tp, dim] of the
hidden states. That local tensor is what a pipeline stage sends and receives.

KV heads. With n_kv_heads % tp == 0, wk and wv are column-parallel like wq. With
n_kv_heads < tp (tp % n_kv_heads == 0), each kv head is REPLICATED on tp / n_kv_heads ranks:
rank r uses kv head r // (tp / n_kv_heads), the one its query heads map to under grouped-query
attention.

Beyond PyTorch's stock styles, and why:
- `_HeadNorm` (q_norm, k_norm): their input is the local heads of column-parallel wq / wk, a
  plain tensor, and their weight (head_dim, shared by every head) belongs to every rank. No
  stock style takes a local input with a replicated weight. The weight is a Replicate
  DTensor; in forward each rank uses its local value, declared to have a Partial gradient
  (`to_local(grad_placements=[Partial()])`): each rank's gradient is its heads' share, and the
  pending sum over tp is the weight's gradient, as for the SequenceParallel norms. Under
  `_KVHeadCopies` a rank's k is a copy of one kv head, used by that rank's queries only; the
  sum over ranks of each copy's share is again the whole gradient.
- `_KVHeadCopies` (wk, wv when n_kv_heads < tp): no stock style splits fewer heads than ranks.
  The weights stay replicated parameters; in forward each is expanded to tp copies of
  [head_dim, dim], one per rank, and sharded by rank (a local slice, no communication).
  DTensor differentiates that exactly: backward all-gathers the copies' gradients and sums them
  into each kv head, so the weights' gradients are Replicate, equal on every tp rank.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from optimus.models.gpt import RMSNorm, rms_norm
from optimus.models.moe import MoE


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a GPT, or a pipeline stage of one, over `tp_mesh` in place.

    Apply before activation checkpointing and FSDP2; the model may still be on the meta device.
    """
    cfg, tp = model.cfg, tp_mesh.size()
    for name, size in (("vocab_size", cfg.vocab_size), ("n_heads", cfg.n_heads),
                       ("ffn_dim", cfg.ffn_dim)):
        assert size % tp == 0, f"tensor parallel needs {name}={size} divisible by tp={tp}"
    if cfg.n_kv_heads % tp == 0:
        kv_style = ColwiseParallel()
    else:
        assert tp % cfg.n_kv_heads == 0, (
            f"n_kv_heads={cfg.n_kv_heads} must divide by tp={tp} or divide it")
        kv_style = _KVHeadCopies(cfg.n_kv_heads)

    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1))
    if model.norm is not None:
        # Without `output` this stage returns hidden states: the local shard, as other stages.
        plan["norm"] = SequenceParallel(use_local_output=model.output is None)
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                         use_local_output=False)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_settle)

    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": kv_style,
            "attention.wv": kv_style,
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            **({"attention.q_norm": _HeadNorm(), "attention.k_norm": _HeadNorm()}
               if block.attention.q_norm is not None else {}),
            "ffn_norm": SequenceParallel(),
            **(_moe_plan() if isinstance(block.feed_forward, MoE) else _feed_forward_plan()),
        })


def _settle(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a plain tensor, its reduce-scatter waited for.

    DTensor hands it over as an AsyncCollectiveTensor (waited for on first use). The blocks
    would then see two input types: the first block that one, the others plain tensors. A
    compiled block would be compiled twice, once for a tensor subclass whose gradient AOT
    autograd returns in the wrong type (DTensor's backward then fails on it)."""
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _feed_forward_plan() -> dict[str, ParallelStyle]:
    return {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _moe_plan() -> dict[str, ParallelStyle]:
    """An MoE layer on this rank's own share of the sequence (see the module's docstring)."""
    return {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Shard(1),),
                                               use_local_output=True)}


def sum_grads_over_tp(params: list[nn.Parameter], tp_group: dist.ProcessGroup) -> None:
    """Sum, in one all-reduce, the gradients of parameters that every tp rank holds whole but
    trains on its own tokens. Call once per step, after the last backward."""
    grads = [g.to_local() if isinstance(g, DTensor) else g
             for p in params if (g := p.grad) is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, total in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(total)


def loss_context(tp_enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward, loss and backward: vocab-parallel cross-entropy under tensor parallel."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()


class _HeadNorm(ParallelStyle):
    """q_norm or k_norm: a replicated weight over each rank's own heads (module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, RMSNorm), module
        distribute_module(module, device_mesh,
                          partial(_replicate_params, src_data_rank=self.src_data_rank))
        module.forward = partial(_head_norm_forward, module)
        return module


def _head_norm_forward(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    weight = module.weight  # read at call time: FSDP2 swaps in the unsharded parameter
    return rms_norm(x, weight.to_local(grad_placements=[Partial()]), module.eps)


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh,
                      src_data_rank: int | None) -> None:
    """`module`'s own parameters as Replicate DTensors (a `distribute_module` partition_fn)."""
    for key, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [Replicate()], src_data_rank=src_data_rank)
        module.register_parameter(key, nn.Parameter(dist, param.requires_grad))


class _KVHeadCopies(ParallelStyle):
    """wk or wv when n_kv_heads < tp: replicated weight, each rank computes its own kv head.

    Output: the local [b, s, head_dim] of kv head tp_rank // (tp / n_kv_heads), like
    ColwiseParallel's local output would be if the weight had tp kv heads.
    """

    def __init__(self, n_kv_heads: int):
        super().__init__()
        self.n_kv_heads = n_kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear) and module.bias is None, module
        distribute_module(module, device_mesh,
                          partial(_replicate_params, src_data_rank=self.src_data_rank))
        # The module's own forward would use every kv head; this one uses the rank's.
        module.forward = partial(_own_kv_head_forward, module, self.n_kv_heads)
        return module


def _own_kv_head_forward(module: nn.Linear, n_kv_heads: int, x: torch.Tensor) -> torch.Tensor:
    weight = module.weight  # read at call time: FSDP2 swaps in the unsharded parameter
    mesh = weight.device_mesh
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    copies = mesh.size() // n_kv_heads
    # [n_kv * head_dim, dim] -> [tp * head_dim, dim]: kv head j repeated for ranks
    # j*copies .. (j+1)*copies - 1; then each rank keeps its copy.
    weight = weight.unflatten(0, (n_kv_heads, -1)).unsqueeze(1)
    weight = weight.expand(-1, copies, -1, -1).flatten(0, 2)
    weight = weight.redistribute(mesh, [Shard(0)])
    return F.linear(x.redistribute(mesh, [Replicate()]), weight).to_local()
