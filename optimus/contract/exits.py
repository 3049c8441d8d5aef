"""How a rank's process ends: the exit statuses `optimus train` leaves for its agent, which
reports them (the exit record, records.py) and the controller judges (controller/control/).

Each status that means something beyond "an error" has one line saying what: the controller
quotes it where a rank said nothing of its own (controller/common/exit_text.py).
"""

from __future__ import annotations

EXIT_OK = 0  # trained to the end, or stopped (with its checkpoint) when asked
EXIT_ERROR = 1  # an exception of its own (its log's last lines say which)
EXIT_USER_ERROR = 2  # the job's own input refused: a setting, the data, the launch, a checkpoint
EXIT_BAD_TILE = 87  # this rank's own loss or gradients were NaN/Inf: its tile is suspect
EXIT_NONFINITE_ELSEWHERE = 88  # the reduced gradients were NaN/Inf, this rank's own were not
EXIT_CHECKPOINT_FAILED = 89  # the final step's save failed, or max_failed_saves in a row did
EXIT_REWIND = 90  # every rank stopped before an update for a rewind (optimus/stability.py)
# ... having printed this line, then JSON ({"step", "since", "verdict", "rule", "value",
# "threshold"}): what the controller reads in its log's tail to plan the rewind.
REWIND_LINE = "rewind-request "

# Status -> what it says, as a clause ("rank 3 ended with exit code 87 (<this>)").
MEANINGS = {
    EXIT_OK: "finished",
    EXIT_ERROR: "an error of its own",
    EXIT_USER_ERROR: "the job's own input was refused (a setting, the data, the launch or a "
                     "checkpoint)",
    EXIT_BAD_TILE: "its own loss or gradients were NaN/Inf",
    EXIT_NONFINITE_ELSEWHERE: "the reduced gradients were NaN/Inf, its own values were not",
    EXIT_CHECKPOINT_FAILED: "its checkpoint saves failed (the final step's, or "
                            "max_failed_saves in a row)",
    EXIT_REWIND: "it stopped for a rewind, saving nothing",
}
# The statuses only a rank of Optimus gives: their meaning is worth saying beside the status.
OWN = (EXIT_BAD_TILE, EXIT_NONFINITE_ELSEWHERE, EXIT_CHECKPOINT_FAILED, EXIT_REWIND)


def meaning(code: int | None) -> str:
    """What exit status `code` says; "" for one the contract gives no meaning."""
    return MEANINGS.get(code, "") if code is not None else ""
