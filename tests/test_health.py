"""Supervision, rank side: heartbeats over a real Unix socket; a clean stop on a real SIGTERM."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from multiproc import free_port

from optimus.checkpoint.manifest import committed_steps
from optimus.config import load_job
from optimus.contract.phases import PHASES
from optimus.models import build_model
from optimus.supervision.commands import Command, Commands
from optimus.supervision.heartbeat import Heartbeat
from optimus.train import train

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "jobs" / "tiny-gpt.yaml"
TINY = ["model.dim=64", "model.n_layers=2", "data.seq_len=32", "data.batch_size=8",
        "optim.warmup_steps=1", "parallel.device=cpu", "supervision.log_every=1",
        "checkpoint.async_mode=thread", "eval.every=0"]  # no validation: heartbeats alone
FIELDS = {"v": int, "rank": int, "local_rank": int, "pid": int, "generation": int,
          "launch": int, "time": float, "step": int, "phase": str, "phase_since": float,
          "compute_s": float, "wait_s": float, "finite": bool, "seq": int, "failed_saves": int,
          "exit_code": type(None), "freed": bool}


class Agent:
    """The node agent's end: a bound Unix datagram socket, read by a thread into `beats`."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.beats: list[dict] = []
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                self.beats.append(json.loads(self.sock.recv(65536).decode()))
            except TimeoutError:
                if self._closing.is_set():  # and nothing more came for a while
                    return

    def wait_for(self, predicate, procs: list[subprocess.Popen], timeout: float = 120) -> None:
        """Until a heartbeat satisfies `predicate`, while every process in `procs` runs."""
        deadline, seen = time.monotonic() + timeout, 0
        while True:
            now = len(self.beats)
            if any(predicate(beat) for beat in self.beats[seen:now]):
                return
            seen = now
            assert all(p.poll() is None for p in procs), "a rank exited early"
            assert time.monotonic() < deadline, "timed out waiting for a heartbeat"
            time.sleep(0.01)

    def close(self) -> None:
        self._closing.set()
        self._reader.join()
        self.sock.close()


@pytest.fixture
def socket_dir():
    # A short directory: a Unix socket path must fit in 108 bytes, and tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="hb", dir="/tmp") as path:
        yield Path(path)


def _env(**extra: str) -> dict:
    launchers = ("OPTIMUS_", "SLURM_", "PALS_", "PMI", "OMPI_", "TORCHELASTIC_", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launchers)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _agent_env(rank: int, world: int, port: int, **extra: str) -> dict:
    """What the node agent gives a rank (optimus.runtime.launch `_agent`)."""
    return _env(OPTIMUS_RANK=str(rank), OPTIMUS_WORLD_SIZE=str(world),
                OPTIMUS_LOCAL_RANK=str(rank), OPTIMUS_LOCAL_WORLD_SIZE=str(world),
                OPTIMUS_MASTER_ADDR="127.0.0.1", OPTIMUS_MASTER_PORT=str(port), **extra)


def _train(overrides: list[str], env: dict, log: Path) -> subprocess.Popen:
    sets = [arg for o in TINY + overrides for arg in ("--set", o)]
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "optimus", "train", str(JOB), *sets],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, log.read_text()[-3000:]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _steps(lines: list[dict]) -> list[int]:
    return [m["step"] for m in lines if "event" not in m]


def test_a_training_process_sends_heartbeats_in_the_protocol(socket_dir, tmp_path):
    agent = Agent(socket_dir / "agent.sock")
    run, steps = tmp_path / "run", 40
    started = time.time()
    proc = _train([f"run_dir={run}", f"optim.steps={steps}", "checkpoint.interval=10",
                   "supervision.heartbeat_interval_s=0.001"],
                  _agent_env(0, 1, free_port(), OPTIMUS_GENERATION="3",
                             OPTIMUS_AGENT_SOCKET=str(agent.path)), tmp_path / "rank0.log")
    _finish(proc, tmp_path / "rank0.log")
    ended = time.time()
    agent.close()

    beats = agent.beats
    assert len(beats) > 100
    for beat in beats:
        assert {k: type(v) for k, v in beat.items()
                if k not in ("metrics", "resume", "memory")} == FIELDS, beat
        assert (beat["v"], beat["rank"], beat["local_rank"]) == (1, 0, 0)
        assert (beat["pid"], beat["generation"]) == (proc.pid, 3)
        assert beat["phase"] in PHASES
        assert started < beat["phase_since"] <= beat["time"] < ended
        assert beat["finite"] is True
    seqs = [b["seq"] for b in beats]
    assert seqs[0] == 0 and all(a < b for a, b in zip(seqs, seqs[1:], strict=False))
    step_seq = [b["step"] for b in beats]
    assert step_seq == sorted(step_seq) and step_seq[-1] == steps
    assert beats[0]["phase"] == "startup" and beats[-1]["phase"] == "done"
    # What it resumed from (nothing: a fresh run), once it has looked; not before.
    assert beats[0]["resume"] is None
    assert beats[-1]["resume"] == {"step": None, "quarantined": [], "source": "disk"}
    assert [b["phase"] for b in beats].count("done") == 1
    assert {"data", "forward", "backward", "grad_sync", "optim", "checkpoint"} <= {
        b["phase"] for b in beats}
    for beat in beats:
        if beat["phase"] == "startup":
            assert beat["compute_s"] == beat["wait_s"] == 0.0
        if beat["step"] >= 2:  # the step before it is done and timed
            assert beat["compute_s"] > 0 and beat["wait_s"] > 0
    # The last step's split covers the step the metrics timed, and no more than that step:
    # it began after the step before was logged, and ended before the last beat ("done").
    logged = {m["step"]: m for m in _metrics(run) if "loss" in m}
    last = _metrics(run)[-1]
    assert last["step"] == steps
    timed = beats[-1]["compute_s"] + beats[-1]["wait_s"]
    assert last["step_time_s"] <= timed <= beats[-1]["phase_since"] - logged[steps - 1]["time"]
    # Rank 0 carries its last logged step's metrics (for the exporter); none before the first.
    assert beats[0]["metrics"] is None
    final = beats[-1]["metrics"]
    assert (final["loss"], final["tokens"], final["step_time_s"]) == (
        last["loss"], last["tokens"], last["step_time_s"])
    assert final["tokens_per_s"] == last["tokens_per_s"] and final["checkpoint_s"] > 0
    # ... and the stability rules' counts and thresholds (not armed: 40 steps < the warm-up)
    assert final["stability"] == {"spikes": 0, "divergences": 0, "skipped_steps": 0,
                                  "loss_threshold": None, "grad_norm_threshold": None}
    # Every rank carries its own peak memory in its last logged step; alone, it is the largest.
    assert beats[0]["memory"] is None
    assert last["memory"] == {**beats[-1]["memory"], "allocated_rank": 0, "reserved_rank": 0}


def _train_beating(rank: int, world_size: int, overrides: list[str], agent_socket: str) -> None:
    os.environ["OPTIMUS_AGENT_SOCKET"] = agent_socket
    if rank == 1:  # rank 1 peaks 512 MiB higher: the largest is not rank 0's own (the ranks'
        torch.ones(128 << 20).sum()  # own peaks differ by ~65 MB: rank 0 writes the metrics)
    train(load_job(JOB, overrides))


def test_metrics_record_the_largest_peak_memory_any_rank_sent(run_ranks, socket_dir, tmp_path):
    agent = Agent(socket_dir / "agent.sock")
    overrides = [*TINY, f"run_dir={tmp_path}", "optim.steps=5", "checkpoint.interval=0",
                 "supervision.heartbeat_interval_s=0.05"]
    try:
        run_ranks(_train_beating, 2, overrides, str(agent.path), timeout=120)
    finally:
        agent.close()
    # Each rank's last heartbeat carries its own peak in the last step, which is logged.
    own = {b["rank"]: b["memory"] for b in agent.beats if b["phase"] == "done"}
    assert own.keys() == {0, 1}
    lines = [m for m in _metrics(tmp_path) if "loss" in m]  # the steps, not the events
    last = lines[-1]["memory"]
    assert last == {"allocated_bytes": own[1]["allocated_bytes"], "allocated_rank": 1,
                    "reserved_bytes": own[1]["reserved_bytes"], "reserved_rank": 1}
    assert own[1]["allocated_bytes"] > own[0]["allocated_bytes"] + (256 << 20)
    # On a CPU: the peak RSS so far, in bytes, so at least the weights, their gradients and
    # Adam's two moments (float32), and never falling from one logged step to the next.
    model = build_model(load_job(JOB, overrides).model, seed=0, device="cpu")
    assert last["allocated_bytes"] > 4 * 4 * sum(p.numel() for p in model.parameters())
    peaks = [m["memory"]["allocated_bytes"] for m in lines]
    assert len(peaks) == 5 and peaks == sorted(peaks)


def test_an_absent_agent_changes_nothing(socket_dir, tmp_path):
    gone = socket_dir / "gone.sock"
    Agent(gone).close()  # an agent that died: its socket file is left, nobody reads it
    losses = []
    for name, extra in (("plain", {}), ("gone", {"OPTIMUS_AGENT_SOCKET": str(gone)})):
        run = tmp_path / name
        proc = _train([f"run_dir={run}", "optim.steps=6", "checkpoint.interval=0",
                       "supervision.heartbeat_interval_s=0.001"], _env(**extra),
                      tmp_path / f"{name}.log")
        _finish(proc, tmp_path / f"{name}.log")
        lines = _metrics(run)
        assert _steps(lines) == [1, 2, 3, 4, 5, 6]
        losses.append(lines[-1]["loss"])
    assert losses[0] == losses[1]


def _drain(sock: socket.socket) -> list[dict]:
    """The datagrams queued on `sock` now."""
    beats = []
    with contextlib.suppress(BlockingIOError):
        while True:
            beats.append(json.loads(sock.recv(65536).decode()))
    return beats


def _bind(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    return sock


def test_heartbeats_survive_a_missing_a_full_and_a_returning_agent(socket_dir):
    path, interval = socket_dir / "agent.sock", 0.005
    queue = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())  # datagrams queued
    beat = Heartbeat(str(path), rank=3, local_rank=1, generation=2, interval_s=interval)
    try:
        time.sleep(20 * interval)  # nobody bound: every send fails (ENOENT)
        agent = _bind(path)
        time.sleep(2 * (queue + 20) * interval)  # bound but not read: the queue fills (EAGAIN)
        queued = _drain(agent)
        assert queued[0]["seq"] > 5  # the sends before were dropped, not held back
        time.sleep(10 * interval)
        later = _drain(agent)
        seqs = [b["seq"] for b in queued + later]
        assert later and len(queued) <= queue + 2  # what the kernel queues, and no more
        assert max(b - a for a, b in itertools.pairwise(seqs)) > 10  # dropped while full
        agent.close()
        path.unlink()
        time.sleep(10 * interval)  # the agent is gone (ENOENT)
        agent = _bind(path)  # and comes back at the same path
        time.sleep(10 * interval)
        again = _drain(agent)
        assert again and again[0]["seq"] > later[-1]["seq"] + 1
        assert {(b["rank"], b["local_rank"], b["generation"]) for b in again} == {(3, 1, 2)}
        beat.finish()
        assert _drain(agent)[-1]["phase"] == "done"
        agent.close()
    finally:
        beat.close()


WAITING = {"data", "grad_sync", "checkpoint", "sync"}  # phases whose time a step waits


@contextlib.contextmanager
def _timed(spans: list, beat: Heartbeat, phase: str | None):
    """The block marked as `phase` (None: no marker), timed by the test's own clock inside
    the marker and around it: (whether the phase waits, inside_s, around_s) onto `spans`."""
    around = time.perf_counter()
    with beat.phase(phase) if phase else contextlib.nullcontext():
        inside = time.perf_counter()
        yield
        inside = time.perf_counter() - inside
    spans.append((phase in WAITING, inside, time.perf_counter() - around))


def _assert_split(done: dict, spans: list, step_s: float) -> None:
    """A step's split by phase against the test's clock: a waiting phase counts at least
    the time inside its block and at most the time around it; the rest of the step is compute.
    However slow a loaded machine is, the figures stay within these bounds; a phase counted on
    the wrong side (or twice) leaves them by that phase's time."""
    inside = {w: sum(i for waits, i, _ in spans if waits == w) for w in (True, False)}
    around = {w: sum(a for waits, _, a in spans if waits == w) for w in (True, False)}
    assert inside[True] <= done["wait_s"] <= around[True], (done, spans)
    assert around[False] <= done["compute_s"] <= step_s - inside[True], (done, spans, step_s)


def test_a_step_splits_into_compute_and_wait_by_phase(socket_dir):
    agent = Agent(socket_dir / "agent.sock")
    beat = Heartbeat(str(agent.path), rank=0, local_rank=0, generation=0, interval_s=0.005)
    beat.resumed(6)
    time.sleep(0.05)
    spans, began = [], time.perf_counter()
    beat.begin_step(7)
    for phase, seconds in (("data", 0.1), ("forward", 0.05), ("grad_sync", 0.05),
                           ("optim", 0.05), ("checkpoint", 0.05)):
        with _timed(spans, beat, phase):
            time.sleep(seconds)
    beat.end_step()
    step_s = time.perf_counter() - began
    beat.logged(float("nan"), 1.0)
    time.sleep(0.05)
    beat.finish()
    agent.close()
    beats = agent.beats
    startup = [b["step"] for b in beats if b["phase"] == "startup"]
    assert set(startup) <= {0, 6} and startup[-1] == 6  # 0 until resumed() says otherwise
    in_step = [b for b in beats if b["step"] == 7 and b["phase"] != "done"]
    assert list(dict.fromkeys(b["phase"] for b in in_step)) == [
        "data", "forward", "grad_sync", "optim", "checkpoint"]
    assert all(b["compute_s"] == 0.0 and b["finite"] for b in in_step if b["phase"] == "data")
    done = beats[-1]
    assert done["phase"] == "done" and done["finite"] is False
    assert done["wait_s"] >= 0.2 and done["compute_s"] >= 0.1  # data, grad_sync, checkpoint
    _assert_split(done, spans, step_s)  # forward, optim: compute



def test_a_collective_phase_lasts_as_long_as_its_call_and_its_wait_counts_once(socket_dir):
    agent = Agent(socket_dir / "agent.sock")
    beat = Heartbeat(str(agent.path), rank=0, local_rank=0, generation=0, interval_s=0.005)
    spans, began = [], time.perf_counter()
    beat.begin_step(11)
    with _timed(spans, beat, "checkpoint"):  # the checkpointer's work, then its agreement
        time.sleep(0.05)
        with beat.phase("checkpoint_sync"):
            time.sleep(0.1)
        time.sleep(0.05)  # staging, say: outside the agreement again
    with _timed(spans, beat, "optim"):
        time.sleep(0.05)
    with _timed(spans, beat, "sync"):  # the commands agreement
        time.sleep(0.05)
    with _timed(spans, beat, None):
        time.sleep(0.05)  # between two markers: still the phase before the agreement
    beat.end_step()
    step_s = time.perf_counter() - began
    beat.finish()
    agent.close()
    in_step = [b for b in agent.beats if b["phase"] not in ("startup", "done")]
    runs = [b["phase"] for i, b in enumerate(in_step)
            if i == 0 or b["phase"] != in_step[i - 1]["phase"]]
    assert runs == ["checkpoint", "checkpoint_sync", "checkpoint", "optim", "sync", "optim"]
    since = {}
    for b in in_step:
        since.setdefault(b["phase"], set()).add(b["phase_since"])
    assert len(since["checkpoint"]) == 1  # given back as it was: the same `since`
    assert len(since["optim"]) == 1
    done = agent.beats[-1]
    assert done["wait_s"] >= 0.25  # checkpoint 0.2 (its agreement once) + sync 0.05
    assert done["compute_s"] >= 0.1  # optim, and the time after the agreement
    _assert_split(done, spans, step_s)  # the nested agreement counted once, not twice

def _agree_after_sigterm(rank: int, world_size: int) -> list:
    before = signal.getsignal(signal.SIGTERM)
    commands = Commands(world_size, torch.device("cpu"), control_file="").listen()
    agreed = [int(commands.agree().commands)]
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # handled: this rank only asks to stop
    agreed.append(int(commands.agree().commands))
    commands.close()
    return [*agreed, signal.getsignal(signal.SIGTERM) == before]


def test_sigterm_on_one_rank_is_agreed_by_all(run_ranks):
    assert run_ranks(_agree_after_sigterm, 2, timeout=60) == [[0, int(Command.STOP), True]] * 2


def _agree_on_a_stop_without_saving(rank: int, world_size: int, folder: str) -> list:
    path = Path(folder) / f"node{rank}.control"
    path.write_text(json.dumps({"pause": False, "checkpoint": 0}))
    commands = Commands(world_size, torch.device("cpu"), control_file=str(path)).listen()
    seen = [commands.agree().no_save]
    if rank == 1:  # its agent: "save": false first, then the SIGTERM
        path.write_text(json.dumps({"pause": False, "checkpoint": 0, "save": False}))
        os.kill(os.getpid(), signal.SIGTERM)
    agreed = commands.agree()
    commands.close()
    return [*seen, agreed.stop, agreed.no_save, commands.no_save]


def test_a_stop_without_saving_is_agreed_by_all_with_its_stop(run_ranks, tmp_path):
    # Node 0's agent has not written its file yet: node 1's word carries both, to everyone.
    assert run_ranks(_agree_on_a_stop_without_saving, 2, str(tmp_path), timeout=60) == [
        [False, True, True, True]] * 2


def _agree_on_control_files(rank: int, world_size: int, folder: str) -> list:
    """Each rank has its own node's control file; they change at different moments."""
    path = Path(folder) / f"node{rank}.control"
    path.write_text(json.dumps({"pause": False, "checkpoint": 3}))
    commands = Commands(world_size, torch.device("cpu"), control_file=str(path))
    seen = [commands.start().checkpoint, commands.checkpoint_done]  # 3 is served already
    if rank == 0:  # only node 0's agent has written the operator's pause and checkpoint yet
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pause": True, "checkpoint": 4}))
        os.replace(tmp, path)
    agreed = commands.agree()
    seen += [agreed.pause, agreed.checkpoint, commands.checkpoint_due(agreed),
             commands.checkpoint_due(agreed)]  # served once
    if rank == 1:  # node 1's file catches up: the same request, not a second checkpoint
        path.write_text(json.dumps({"pause": True, "checkpoint": 4}))
    agreed = commands.agree()
    seen += [agreed.pause, commands.checkpoint_due(agreed)]
    if rank == 0:  # resumed on node 0 only: everybody stays paused until node 1 sees it too
        path.write_text(json.dumps({"pause": False, "checkpoint": 4}))
    seen.append(commands.agree().pause)
    if rank == 1:
        path.write_text(json.dumps({"pause": False, "checkpoint": 4}))
    seen.append(commands.agree().pause)
    return seen


def test_ranks_agree_on_the_control_word_whichever_saw_it_first(run_ranks, tmp_path):
    expected = [3, 3, True, 4, True, False, True, False, True, False]
    assert run_ranks(_agree_on_control_files, 2, str(tmp_path), timeout=60) == [expected] * 2


def test_sigterm_to_one_rank_stops_both_after_one_step_then_resume(socket_dir, tmp_path):
    agent = Agent(socket_dir / "agent.sock")
    run, steps = tmp_path / "run", 200
    overrides = [f"run_dir={run}", f"optim.steps={steps}", "checkpoint.interval=50",
                 "supervision.heartbeat_interval_s=0.02"]
    port = free_port()
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [_train(overrides, _agent_env(r, 2, port, OPTIMUS_AGENT_SOCKET=str(agent.path)),
                    logs[r]) for r in range(2)]
    try:
        agent.wait_for(lambda b: b["rank"] == 1 and b["step"] >= 3, procs)
        os.kill(procs[1].pid, signal.SIGTERM)
        for proc, log in zip(procs, logs, strict=True):
            _finish(proc, log)
    finally:
        for proc in procs:
            proc.kill()

    last = {r: [b for b in agent.beats if b["rank"] == r][-1] for r in range(2)}
    assert [last[r]["pid"] for r in range(2)] == [p.pid for p in procs]
    assert last[0]["phase"] == last[1]["phase"] == "done"
    stopped = last[0]["step"]
    assert last[1]["step"] == stopped and 3 <= stopped < steps
    lines = _metrics(run)
    assert _steps(lines)[-1] == stopped
    (event,) = [m for m in lines if m.get("event") == "stopped"]
    assert (event["step"], event["checkpoint_step"]) == (stopped, stopped)
    assert committed_steps(run / "checkpoints")[-1] == stopped

    # A new run of the job (one rank now) resumes from there; stopped again, it saves again.
    proc = _train(overrides, _agent_env(0, 1, free_port(), OPTIMUS_AGENT_SOCKET=str(agent.path)),
                  tmp_path / "resumed.log")
    try:
        agent.wait_for(lambda b: b["pid"] == proc.pid and b["step"] > stopped + 1, [proc])
        proc.send_signal(signal.SIGTERM)
        _finish(proc, tmp_path / "resumed.log")
    finally:
        proc.kill()
        agent.close()
    resumed = _metrics(run)[len(lines):]
    assert [m["step"] for m in resumed if m.get("event") == "resume"] == [stopped]
    (event,) = [m for m in resumed if m.get("event") == "stopped"]
    assert stopped + 1 < event["step"] < steps and event["checkpoint_step"] == event["step"]
    assert _steps(resumed) == list(range(stopped + 1, event["step"] + 1))
    assert committed_steps(run / "checkpoints")[-1] == event["step"]
