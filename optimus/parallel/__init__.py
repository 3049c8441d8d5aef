"""Parallel plans, applied to a plain model from outside (DESIGN.md, Parallelism).

Order: pipeline split, then per stage tensor parallel -> activation checkpointing -> compile
-> data-parallel sharding (`plan.build_parallel_model`). Submodules are imported by name.
Which ranks a plan spans it asks the layout's mesh by purpose (optimus/runtime/mesh.py).
"""
