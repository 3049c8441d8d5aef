"""Parallel plans, applied to a plain model from outside (DESIGN.md, Parallelism).

Order: pipeline split, then per stage tensor parallel -> activation checkpointing -> compile
-> data-parallel sharding (`plan.build_parallel_model`). Submodules are imported by name:
`schedule_rules` is read by the config validator before torch is needed.
"""
