"""What each activation-recompute mode runs again in backward, counted op by op.

A backward without recompute runs the gradient matmuls only (two per forward matmul); `full`
also runs every forward op of a block again; `op` runs again only the element-wise ops (the
norms, RoPE, SwiGLU's product) and none of the matmuls or attention, whose outputs it kept.
The counts come from a TorchDispatchMode around `backward()`, so they are what really ran.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_moe import moe_job
from test_parallel_matrix import base_job, relative_error
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.config import validate_job
from optimus.models import build_model
from optimus.parallel.activation_checkpoint import apply_activation_checkpointing
from optimus.parallel.plan import cross_entropy_sum


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(raw: dict, mode: str) -> tuple[Counter, dict[str, torch.Tensor]]:
    model = build_model(validate_job(raw).model, seed=3)
    apply_activation_checkpointing(model, mode)
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    loss = cross_entropy_sum(model(batch[:, :-1]), batch[:, 1:])
    counter = OpCounter()
    with counter:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad
             for n, p in model.named_parameters()}
    return counter.ops, grads


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_op_mode_recomputes_elementwise_ops_and_no_matmul(kind):
    raw = base_job() if kind == "dense" else moe_job()
    none, want = backward_ops(raw, "none")
    full, _ = backward_ops(raw, "full")
    op, grads = backward_ops(raw, "op")
    matmuls = ("mm", "bmm", "addmm")
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    # full recompute runs the forward's matmuls and attention again; op runs none of them
    assert sum(full[m] for m in matmuls) > sum(none[m] for m in matmuls)
    assert full[attention] > none[attention] == 0
    assert sum(op[m] for m in matmuls) == sum(none[m] for m in matmuls)
    assert op[attention] == 0
    # ... but it does recompute the element-wise ops: RMSNorm's rsqrt, SwiGLU's SiLU
    for name in ("rsqrt", "silu"):  # RMSNorm decomposes; rsqrt is its own
        assert op[name] > none[name], name
        assert op[name] == full[name], name
    for name, grad in want.items():  # and the gradients are the same
        assert relative_error(grads[name], grad) <= 1e-6, name
