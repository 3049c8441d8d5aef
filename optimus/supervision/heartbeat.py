"""Heartbeats: a rank tells its node's agent where it is.

When the node agent gives a rank OPTIMUS_AGENT_SOCKET, the path of a Unix datagram
socket it has bound, a daemon thread sends it one UTF-8 JSON object per datagram: one at start,
one every `supervision.heartbeat_interval_s`, and a last one with phase "done" when training
ends normally. Version 1 of the datagram, every field always present:

    {"v": 1, "rank": 5, "local_rank": 1, "pid": 4242, "generation": 2, "launch": 0,
     "time": 1.79e9,
     "step": 120, "phase": "backward", "phase_since": 1.79e9, "compute_s": 0.41,
     "wait_s": 0.03, "finite": true, "seq": 57, "resume": null, "metrics": null,
     "memory": {"allocated_bytes": 61203824640, "reserved_bytes": 66571993088},
     "failed_saves": 0, "exit_code": null, "freed": false}

- generation: OPTIMUS_GENERATION (`launch_env().restart_count`); time: time.time() at the send.
- launch: OPTIMUS_REPLICA_LAUNCH, its replica's launch within the generation (replicas that
  carry on relaunch one replica in it; 0 otherwise): the agent takes no beat of a launch left.
- failed_saves: checkpoint saves failed in a row (agreed; it counts on from OPTIMUS_FAILED_SAVES,
  which the agent sets from the plan: checkpoint.max_failed_saves counts across generations).
- step: the step in progress; before the first one, the step the run resumed from (0: none).
- phase, phase_since: where the rank is, and since when (time.time()). "startup" until the first
  step; then per step "data" (fetching the microbatches), "forward" and "backward" (a pipeline
  schedule interleaves the two, so its whole step is "forward"), "optim", "checkpoint" (the
  checkpointer's own work at the step boundary: staging a save's tensors, finishing one); after
  the last step "checkpoint" while the last save lands, and "done".
  Every collective the loop itself runs is marked by one of three collective phases
  (COLLECTIVE_PHASES), whatever its purpose: "grad_sync" (the step's reductions: the token
  count, the gradient clip, the experts' load, the loss of a logged step), "checkpoint_sync"
  (the checkpointer's agreements and broadcasts, DCP's collective load and synchronous save,
  its process group's creation: `Checkpointer(collective=...)`), "sync" (the process groups'
  setup, the commands agreement at every step boundary and before the first step, the barrier
  at exit). A collective phase lasts exactly as long as its call: the rank then goes back to
  the phase it was in (inside "checkpoint", or "startup"), so a rank outside every collective
  never reads as waiting in one. The controller names the rank outside them, or behind in
  step, as a hang's culprit (both sides take the phases from optimus/contract/phases.py). The
  other phases last until the next is entered. "paused" is not one: a paused job is not
  checked for hangs.
- compute_s, wait_s: the last completed step's host wall-clock time split in two (0.0 before the
  first). wait_s is the time spent in "data", the collective phases and "checkpoint" (the
  checkpointer's poll and save: staging the tensors, not the background write); compute_s is
  the rest of the step. So the collectives inside the model (FSDP's all-gathers and
  reduce-scatters in forward and backward, tensor-parallel all-reduces, pipeline sends and
  receives) count as compute, and so does the time they spend waiting for a slow peer. On an
  accelerator the host runs ahead of the device: device work queued earlier is charged to
  whichever phase first blocks on it.
- exit_code: null; phase "ready" (between generations, inprocess.py): the exit status
  the rank would have had, had it not stayed for the next generation.
- freed: false; true in phase "ready" once the rank has freed the generation it left (it does
  so after its first "ready" beat, while the next generation is planned).
- finite: whether the last logged loss and grad norm were finite; true until one is logged.
- seq: 0 for the first datagram, then +1 for each.
- resume: null until the rank has loaded its checkpoint (or found none), then {"step": the
  checkpoint's step, null when it starts from scratch; "quarantined": the steps of newer
  checkpoints it set aside as corrupt}: what the generation really resumed from, which the
  controller reports (its plan named what it expected).
- metrics: null, but on global rank 0 once a step is logged: {"loss", "tokens" (trained so
  far, all ranks), "tokens_per_s", "mfu" (null where the device's peak is unknown),
  "step_time_s", "checkpoint_s" (the last save, from its start to this rank's files written;
  null before one), "moe_alltoall_bytes" (what the experts' all-to-alls sent between ranks
  in the step, whole job; 0 without expert parallelism)}. The controller's Prometheus exporter reads
  them from Redis.
- memory: null until a step is logged, then this rank's own peak memory in that step:
  {"allocated_bytes", "reserved_bytes"} (optimus/runtime/memory.py; on a CPU, both the peak
  resident set size so far). Each agent keeps its node's largest; the exporter and `optimus job
  status` show the largest of all nodes.

The socket never blocks, and every send error (no agent yet, agent gone, its queue full) is
ignored: the next beat tries again, and reaches an agent that binds the same path again.
Training only writes fields here (a few time.perf_counter()/time.time() calls a step); without
OPTIMUS_AGENT_SOCKET `start_heartbeat` returns an object that does nothing and starts no thread.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time

from optimus.contract.env import AGENT_SOCKET
from optimus.contract.phases import COLLECTIVE_PHASES, DONE, PHASES, READY, STARTUP
from optimus.runtime.launch import LaunchEnv

VERSION = 1  # of the datagram


def _finite(value):
    """A figure, or a dict of them (the stability rules' counts and thresholds), with every
    number that is not finite as None."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value if value is None or math.isfinite(value) else None


def start_heartbeat(env: LaunchEnv, interval_s: float) -> Heartbeat | NoHeartbeat:
    """Heartbeats to the agent at $OPTIMUS_AGENT_SOCKET; a do-nothing object when it is unset."""
    path = os.environ.get(AGENT_SOCKET)
    if not path:
        return NO_HEARTBEAT
    from optimus.supervision.inprocess import launch_count

    return Heartbeat(path, rank=env.rank, local_rank=env.local_rank,
                     generation=env.restart_count, interval_s=interval_s,
                     launch=launch_count())


class Heartbeat:
    """This rank's state, sent to the agent by a daemon thread; the training loop updates it."""

    def __init__(self, path: str, *, rank: int, local_rank: int, generation: int,
                 interval_s: float, launch: int = 0):
        self.path, self.interval_s = path, interval_s
        self._fixed = {"v": VERSION, "rank": rank, "local_rank": local_rank, "pid": os.getpid(),
                       "generation": generation, "launch": launch}
        # Each field the sender reads together is one tuple, replaced whole: never torn.
        self._step = 0
        self._phase = (STARTUP, time.time())
        self._last = (0.0, 0.0)  # compute_s, wait_s of the last completed step
        self._finite = True
        self._metrics: dict | None = None  # rank 0's last logged step (see the module doc)
        self._resume: dict | None = None  # what this rank resumed from, once it knows
        self._memory: dict | None = None  # this rank's peak memory in its last logged step
        self._validation: dict | None = None  # rank 0's last validation: val_loss, val_step
        self._failed_saves = 0  # checkpoint saves failed in a row (agreed by all ranks)
        self._exit_code: int | None = None  # between generations: see `left`
        self._freed = False  # and `freed`
        self._step_began = 0.0
        self._waited = 0.0  # in the step in progress
        self._waiting = False  # inside a waiting phase (a nested one adds nothing more)
        self._seq = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="optimus-heartbeat", daemon=True)
        self._thread.start()

    # --- called by the training loop -----------------------------------------------------------

    def phase(self, name: str) -> _Phase:
        """`with heartbeat.phase("optim"): ...` marks the block as that phase; a collective
        phase gives the phase it interrupted back at its end."""
        return _Phase(self, name, PHASES[name], name in COLLECTIVE_PHASES)

    def resumed(self, step: int, checkpoint: int | None = None,
                quarantined: tuple[int, ...] = (), source: str = "disk") -> None:
        """The last step done before this run's first (the checkpoint's step; 0 for none), the
        checkpoint loaded (None: none), the newer ones set aside as corrupt, and where the state
        came from: "disk" or "memory" (an in-memory snapshot)."""
        self._step = step
        self._resume = {"step": checkpoint, "quarantined": list(quarantined), "source": source}

    def begin_step(self, step: int) -> None:
        self._step = step
        self._waited = 0.0
        self._step_began = time.perf_counter()

    def end_step(self) -> None:
        wall = time.perf_counter() - self._step_began
        self._last = (wall - self._waited, self._waited)

    def logged(self, loss: float, grad_norm: float, metrics: dict | None = None,
               memory: dict | None = None) -> None:
        """A logged step: whether its loss and norm were finite, this rank's peak memory in it;
        rank 0 adds its metrics."""
        self._finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self._memory = memory
        if metrics is not None:  # JSON has no NaN: a figure that is not finite goes as null
            self._metrics = {k: _finite(v) for k, v in metrics.items()}

    def validated(self, summary: dict | None) -> None:
        """Rank 0's last validation ({"val_loss", "val_step"}), sent beside its metrics."""
        self._validation = summary

    def saves_failed(self, count: int) -> None:
        """How many checkpoint saves failed in a row: the agent carries it into the next
        generation, so that a restart does not reset checkpoint.max_failed_saves's count."""
        self._failed_saves = count

    def nonfinite(self) -> None:
        """This rank's own loss or gradients are NaN/Inf: say so now, not at the next beat."""
        self._finite = False
        self._send()

    def left(self, code: int) -> None:
        """This rank left its generation and waits in process for the next (inprocess.py):
        phase "ready", with the exit status it would have had; sent now."""
        self._phase, self._exit_code = (READY, time.time()), code
        self._send()

    def freed(self) -> None:
        """The generation this rank left is freed (inprocess.py); sent now."""
        self._freed = True
        self._send()

    def finish(self) -> None:
        """Training is over: stop the thread, send the last beat (phase "done"), close."""
        self._stop_thread()
        self._phase = (DONE, time.time())
        self._send()
        self.close()

    def close(self) -> None:
        """Stop sending, without a last beat (training failed: the agent sees the exit)."""
        self._stop_thread()
        self._sock.close()

    # --- the sender ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._send()
            if self._stopping.wait(self.interval_s):
                return

    def _stop_thread(self) -> None:
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _send(self) -> None:
        step = self._step  # read first: a step >= 2 then always comes with its predecessor's times
        phase, since = self._phase
        compute_s, wait_s = self._last
        beat = {**self._fixed, "time": time.time(), "step": step, "phase": phase,
                "phase_since": since, "compute_s": compute_s, "wait_s": wait_s,
                "finite": self._finite, "seq": self._seq, "resume": self._resume,
                "metrics": self._metrics if self._validation is None else {
                    **(self._metrics or {}), **self._validation}, "memory": self._memory,
                "failed_saves": self._failed_saves, "exit_code": self._exit_code,
                "freed": self._freed}
        self._seq += 1
        with contextlib.suppress(OSError):  # no agent, agent gone, queue full: try next time
            self._sock.sendto(json.dumps(beat).encode(), self.path)


class _Phase:
    """Marks a phase on entry; a waiting phase adds its duration to the step's wait (once: not
    again when nested in another waiting phase); a collective phase ends with its block."""

    __slots__ = ("beat", "name", "waits", "collective", "began", "outer", "counts")

    def __init__(self, beat: Heartbeat, name: str, waits: bool, collective: bool):
        self.beat, self.name, self.waits, self.collective = beat, name, waits, collective

    def __enter__(self) -> None:
        beat = self.beat
        self.outer = beat._phase
        if beat._phase[0] != self.name:  # a phase entered again goes on: same `since`
            beat._phase = (self.name, time.time())
        self.counts = self.waits and not beat._waiting
        if self.counts:
            beat._waiting = True
            self.began = time.perf_counter()

    def __exit__(self, *exc) -> None:
        beat = self.beat
        if self.counts:
            beat._waited += time.perf_counter() - self.began
            beat._waiting = False
        if self.collective:  # the collective is over: back to what the rank was doing
            beat._phase = self.outer


class NoHeartbeat:
    """Heartbeats off: the same calls, doing nothing."""

    __slots__ = ()
    _nothing = contextlib.nullcontext()

    def phase(self, name: str) -> contextlib.nullcontext:
        return self._nothing

    def resumed(self, step: int, checkpoint: int | None = None,
                quarantined: tuple[int, ...] = (), source: str = "disk") -> None:
        pass

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self) -> None:
        pass

    def logged(self, loss: float, grad_norm: float, metrics: dict | None = None,
               memory: dict | None = None) -> None:
        pass

    def validated(self, summary: dict | None) -> None:
        pass

    def saves_failed(self, count: int) -> None:
        pass

    def nonfinite(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_HEARTBEAT = NoHeartbeat()
