"""The faults Optimus injects on purpose (chaos), in one table: the job file's
`fault_injection.faults` (optimus/config/schema.py), the rank's own hooks
(optimus/supervision/faults.py), the agent's commands (controller/node/commands.py) and
`optimus chaos` (controller/cli/main.py) all take their kinds from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    name: str  # as the job file and the agent's commands spell it; `optimus chaos` uses dashes
    what: str  # what it does, for the help and the confirmation
    job_file: bool  # planned in a job file (fault_injection.faults)
    operator: bool  # sent while the job runs (`optimus chaos`, through the node's agent)
    in_step: bool = False  # an operator's reaches the rank, which fires it in a step


KINDS = (
    Kind("kill_rank", "SIGKILL to the rank (a crash)", True, True),
    Kind("freeze_rank", "SIGSTOP to the rank (its heartbeats stop)", True, True),
    Kind("hang_rank", "the rank blocks in its next step (a hung device sync); its peers wait in "
         "a collective", True, True, in_step=True),
    Kind("stall_rank", "the rank sleeps --seconds in its next step, outside any collective",
         True, True, in_step=True),
    Kind("nan_rank", "the rank's loss and gradients turn NaN from its next step on (a tile "
         "computing wrong: nothing since its node's last passing check is trusted)", True, True,
         in_step=True),
    Kind("slow_rank", "the rank spends `seconds` more on every step from `step` on (a "
         "straggler)", True, False),
    Kind("kill_node", "SIGKILL to the node's agent and its ranks (a lost node)", True, True),
    Kind("bad_tile", "the node's tile --tile computes wrong (its next health check fails)",
         False, True),
    Kind("spike", "every rank's share of step --at-step's batch turns to random tokens: a real "
         "loss spike, for the job's stability rules (stability.on_spike)", True, True),
)
BY_NAME = {k.name: k for k in KINDS}
JOB_FILE = tuple(k.name for k in KINDS if k.job_file)  # fault_injection.faults[].kind
OPERATOR = tuple(k.name for k in KINDS if k.operator)  # `optimus chaos FAULT`
IN_STEP = tuple(k.name for k in KINDS if k.in_step)  # fired by the rank, in a step it names
SPIKE = "spike"  # every rank poisons its share of one step: fired in a step, no rank named
KILL_NODE = "kill_node"  # carried out by the node's agent, not by a rank
# What an agent writes into its ranks' chaos file ($OPTIMUS_CHAOS_FILE) for them to fire.
RANK_FIRED = (*IN_STEP, SPIKE)


def word(name: str) -> str:
    """A kind as `optimus chaos` takes it: `hang-rank`."""
    return name.replace("_", "-")


def from_word(text: str) -> str:
    """The kind `optimus chaos` names: `hang-rank` -> `hang_rank`."""
    return text.replace("-", "_")
