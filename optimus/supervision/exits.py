"""How a rank's training fails in a way its agent and the controller read from its exit status
(optimus/contract/exits.py): `optimus train` exits with the error's `exit_code`."""

from __future__ import annotations

from optimus.contract.exits import EXIT_BAD_TILE, EXIT_CHECKPOINT_FAILED, EXIT_NONFINITE_ELSEWHERE


class NonFinite(Exception):
    """A step whose global gradient norm is NaN/Inf: no rank may step on it."""

    def __init__(self, step: int, local: bool, detail: str):
        self.step, self.local = step, local
        self.exit_code = EXIT_BAD_TILE if local else EXIT_NONFINITE_ELSEWHERE
        where = ("this rank's own values (its tile is suspect)" if local
                 else "another rank's values (this rank's own are finite)")
        super().__init__(f"non-finite gradient norm at step {step}, from {where}: {detail}")


class CheckpointFailed(Exception):
    """Training cannot end well: its final checkpoint, or too many saves in a row, failed. All
    ranks raise it after the same step (the saves' outcomes are agreed); a restart would fail the
    same way, so the controller ends the job with this message instead."""

    exit_code = EXIT_CHECKPOINT_FAILED
