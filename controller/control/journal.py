"""The controller's journal, `<run_dir>/controller.json`, read back: the job record, the last
plan and the exclusions, written by the leading controller (controller.py) on every change.

It outlives Redis and the allocation, and its node names go on into Redis (the controller
rebuilding a lost store, `optimus controller --allocation`) and into batch scripts
(`optimus submit slurm` turns its exclusions into `#SBATCH --exclude=`; `optimus submit pbs`
checks it before the job starts). So every reader takes it from here, where each name in it is
checked against the one rule (controller/store/names.py), and its plan is a whole plan of the
contract (optimus/contract/records.py): a journal naming a node by anything else, or with a
plan a controller does not write, is refused whole, with one line that says where.
"""

from __future__ import annotations

import json
from pathlib import Path

from controller.store.names import RULE, is_node_name, shown
from optimus.config import ConfigError
from optimus.contract.records import Plan, RecordError


def read_journal(path: Path) -> dict:
    """What the journal holds: {} when there is none or it is not a JSON object; a ConfigError
    naming the first node name in it that is no node name (or an `excluded` of the wrong shape,
    or the field of its `plan` that is missing or mistyped)."""
    try:
        journal = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(journal, dict):
        return {}
    excluded, plan = journal.get("excluded") or {}, journal.get("plan") or {}
    if not isinstance(excluded, dict) or not all(isinstance(e, dict) for e in excluded.values()):
        raise _refused(path, "its `excluded` is not a map of node names to records")
    nodes = plan.get("nodes", []) if isinstance(plan, dict) else None
    if not isinstance(nodes, list):
        raise _refused(path, "its `plan` has no list of `nodes`")
    for name in [*excluded, *nodes]:
        if not is_node_name(name):
            raise _refused(path, f"names a node {shown(name)}, which is not a node name ({RULE})")
    if plan:
        try:
            Plan.parse(plan)
        except RecordError as e:
            raise _refused(path, f"its {e}") from None
    return journal


def _refused(path: Path, what: str) -> ConfigError:
    return ConfigError(str(path), what, "a controller wrote no such thing: delete the entry, or "
                       "the file (the controller then takes the job's state from Redis, or "
                       "starts it again from its latest committed checkpoint)")
