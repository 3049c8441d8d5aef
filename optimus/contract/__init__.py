"""The contract between a rank, its node's agent and the controller, written down once: both
sides import it, neither spells its constants again.

- exits.py: the exit statuses of `optimus train`, each with what it says;
- phases.py: the phases a rank's heartbeat names, which are collective, the phase of a rank
  between generations, and the words of a collective whose peer is gone;
- chaos.py: the kinds of fault injected on purpose (job file, operator, agent, rank);
- env.py: every `OPTIMUS_*` environment variable;
- process.py: a child that dies with its parent;
- records.py: the plan and the exit record, typed and versioned, checked where they are read.

Standard library and pydantic only: importing it loads no torch, and nothing else of optimus
or controller (tests/test_contract.py holds it to that).
"""

from optimus.contract.exits import (
    EXIT_BAD_TILE,
    EXIT_CHECKPOINT_FAILED,
    EXIT_ERROR,
    EXIT_NONFINITE_ELSEWHERE,
    EXIT_OK,
    EXIT_REWIND,
    EXIT_USER_ERROR,
)
from optimus.contract.phases import COLLECTIVE_PHASES, PEER_FAILURE, PHASES, READY
from optimus.contract.process import die_with_parent
from optimus.contract.records import ExitRecord, Plan, RecordError

__all__ = [
    "COLLECTIVE_PHASES", "EXIT_BAD_TILE", "EXIT_CHECKPOINT_FAILED", "EXIT_ERROR",
    "EXIT_NONFINITE_ELSEWHERE", "EXIT_OK", "EXIT_REWIND", "EXIT_USER_ERROR", "PEER_FAILURE",
    "PHASES", "READY", "ExitRecord", "Plan", "RecordError", "die_with_parent",
]
