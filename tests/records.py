"""Whole records of the contract (optimus/contract/records.py) for tests that write them into
Redis: a run plan an agent could launch, and an exit record as an agent writes it."""

from __future__ import annotations

import time

from optimus.contract.records import VERSION, ExitRecord, Plan


def run_plan(generation: int, nodes: list[str], ranks_per_node: int = 1, **more) -> dict:
    """A "run" plan of `generation` on `nodes`, every field an agent launches from present."""
    return {"version": VERSION, "generation": generation, "action": "run", "nodes": list(nodes),
            "ranks_per_node": ranks_per_node, "world_size": len(nodes) * ranks_per_node,
            "master_addr": nodes[0] if nodes else "", "master_port": 0,
            "job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs", **more}


def as_record(plan: dict) -> Plan:
    """`plan` (a run plan's fields that matter to a test) as the typed record an agent reads,
    the fields it launches from filled in where the test gives none."""
    return Plan.parse({**run_plan(plan["generation"], plan["nodes"],
                                 plan.get("ranks_per_node", 1)), **plan})


def exit_record(node: str, rank: int, generation: int = 0, **more) -> ExitRecord:
    """Rank `rank` on `node` exited with status 1 (`more` changes any field)."""
    fields = {"node": node, "rank": rank, "local_rank": 0, "generation": generation, "pid": 4242,
              "code": 1, "signal": None, "by_agent": False, "time": time.time(), "tail": "",
              "tail_age": None, **more}
    return ExitRecord(**fields)
