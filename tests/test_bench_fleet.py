"""The controller-scale benchmark's simulated agents send what a real agent's tick sends."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.controller_scale_fleet import check_commands  # noqa: E402


def test_the_simulated_tick_is_the_agents_tick_byte_for_byte():
    """bench/controller_scale.py refuses to start otherwise: a change to OwnRecords.agent_tick
    (the peak-memory rows were one) must reach the simulator, or the bench measures a
    controller fed other traffic than production's."""
    check_commands("redis://127.0.0.1:1/0", {})  # raises SystemExit on the first difference
