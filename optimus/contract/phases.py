"""Where a rank is, as its heartbeat says (optimus/supervision/heartbeat.py marks them; the
agent sums them up, the controller judges hangs by them).

A rank is in "startup" until its first step; then per step "data", "forward", "backward"
(a pipeline schedule's whole step is "forward"), "optim", and "checkpoint" for the
checkpointer's own work at the step boundary; "eval" while it validates, "paused" while the
job is, "done" once training has ended. Every collective the loop itself runs is marked by one
of the collective phases for exactly as long as its call, whatever its purpose: a rank outside
them while others wait in one holds them up (a hang's culprit).

A rank between generations (in-process restart, optimus/supervision/inprocess.py) beats in
phase READY; a collective's error that says a peer is gone (PEER_FAILURE) is not the rank's own
fault, on both sides: the rank may then stay for the next generation, and the controller takes
its exit for collateral.
"""

from __future__ import annotations

import re

STARTUP, DATA, FORWARD, BACKWARD, OPTIM = "startup", "data", "forward", "backward", "optim"
CHECKPOINT, EVAL, PAUSED, DONE = "checkpoint", "eval", "paused", "done"
# The collective phases: the step's reductions (token count, gradient clip, experts' load, a
# logged loss); the checkpointer's agreements, broadcasts and collective loads and saves; the
# process groups' setup, the commands agreement at every step boundary, the barrier at exit.
GRAD_SYNC, CHECKPOINT_SYNC, SYNC = "grad_sync", "checkpoint_sync", "sync"
COLLECTIVE_PHASES = (GRAD_SYNC, CHECKPOINT_SYNC, SYNC)
READY = "ready"  # between generations: left one, waits in process for the next
# A replica's rank waiting to be let into a quorum (optimus/parallel/replica_mode.py): it holds
# nobody up, and all of a relaunched replica's ranks in it tell the controller to let it in.
STANDBY = "standby"

# Each phase of a generation, and whether its time counts as waiting (the rest of a step is
# compute). A validation is not the step's compute: counted with waiting, it cannot make a
# step that validates look like a straggler's.
PHASES = {STARTUP: False, DATA: True, FORWARD: False, BACKWARD: False, GRAD_SYNC: True,
          OPTIM: False, CHECKPOINT: True, CHECKPOINT_SYNC: True, SYNC: True, PAUSED: True,
          EVAL: True, DONE: False, STANDBY: True}
# Phases longer than a training step, with no history of their own: a save (its writing and
# the agreements around it) and a validation.
LONG_PHASES = (CHECKPOINT, CHECKPOINT_SYNC, EVAL)

# What a collective (or the rendezvous) says when a peer is gone: gloo, NCCL, XCCL and the TCP
# store word it differently; and what a rank of a replica the controller took out of the quorum
# says (optimus/parallel/quorum_file.py ReplicaOut): its launch ended under it, as by a peer.
PEER_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|ECONNREFUSED|Connection refused|"
    r"Socket Timeout|timed out|Timeout|DistNetworkError|DistStoreError|gloo::IoException|"
    r"NCCL (error|communicator)|ProcessGroup.*(abort|error)|peer .*(died|exited|closed)|"
    r"Read error|Write error|is out of quorum",
    re.IGNORECASE)
