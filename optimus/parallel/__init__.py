"""Parallel plans, applied to a plain model from outside (DESIGN.md, Parallelism).

Order: pipeline split, then per stage tensor parallel -> activation checkpointing -> compile
-> data-parallel sharding. This build applies the data-parallel part; the other plans refuse
clearly until they land.
"""

from optimus.parallel.data_parallel import apply_data_parallel, set_gradient_sync
from optimus.parallel.grads import clip_grad_norm_
from optimus.parallel.plan import parallelize

__all__ = ["apply_data_parallel", "clip_grad_norm_", "parallelize", "set_gradient_sync"]
