"""Replicas that carry on (optimus/parallel/replicas.py), in real processes: each replica its
own process (or world of processes), the quorum groups made on a TCPStore this test serves, the
quorum written by this test as the controller writes it, real SIGKILL and SIGSTOP.

What is checked is what the mode promises: survivors keep their processes and apply every step
exactly once; the step's gradient is that of the loss over the tokens of the replicas taking
part (against one process computing it from the recorded membership); a replica that rejoins
is healed from a live peer to the same bits; every replica's samples are trained exactly at
the steps its replica was a member.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import replica_rank  # noqa: E402
from replica_run import Run  # noqa: E402

from optimus.contract.records import Quorum  # noqa: E402
from optimus.parallel.replicas import (  # noqa: E402
    QuorumError,
    ReplicaOut,
    checksum,
    device_checksum,
    read_quorum,
    switch_step,
    wait_for_quorum,
)
from optimus.supervision import inprocess  # noqa: E402


def reference(membership: dict[int, list[int]], shard: int = 1) -> list[torch.Tensor]:
    """One process: each step's loss over the tokens of the replicas that took part in it."""
    net = replica_rank.model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in sorted(membership):
        total, tokens = 0.0, 0.0
        for r in membership[step]:
            for p in range(shard):
                x, y, mask = replica_rank.batch(step, r, p)
                total = total + replica_rank.loss_sum(net, x, y, mask)
                tokens += float(mask.sum())
        (total / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in net.parameters()]


def params_of(state: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model's weights in a saved state (state_tensors: the model's state dict first, by
    key: 0.bias, 0.weight, 2.bias, 2.weight)."""
    bias0, weight0, bias2, weight2 = state[:4]
    return [weight0, bias0, weight2, bias2]


def membership(run: Run, replica: int) -> dict[int, list[int]]:
    """Step -> the replicas that took part in it, as `replica` applied it (each step once)."""
    rows = run.lines(replica)
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"replica {replica} applied a step twice: {steps}"
    return {r["step"]: r["members"] for r in rows}


def assert_trained_where_member(run: Run, members: dict[int, list[int]], replicas,
                                position: int = 0, lost_at: int | None = None) -> None:
    """Every replica's samples of a step were trained exactly when it was a member of that
    step's quorum: its own processes applied those steps, no others. The one exception: the
    step a killed process was in when it died, if its exchange had completed (its part is in
    the others' update) but it had not yet logged the step (`lost_at`: its last logged)."""
    for r in replicas:
        applied = {row["step"] for row in run.lines(r, position)}
        member = {s for s, m in members.items() if r in m}
        assert applied <= member, (r, sorted(applied - member))
        assert member - applied <= ({lost_at + 1} if lost_at is not None else set()), \
            (r, sorted(member - applied))


def test_a_killed_replica_leaves_the_others_stepping_and_rejoins_healed(run_of):
    steps = 40
    run = run_of(steps=steps, step_s=0.05)
    standby = run.start(2, after=1)  # replica 2's: past its imports, waiting for a later quorum
    run.wait(lambda: run.ready(2, 1))
    run.quorum([0, 1, 2])
    for r in range(3):
        run.start(r)
    victim = run.procs[2, 0]
    run.wait(lambda: run.last_step(2) >= 4)
    survivors = {r: run.procs[r, 0].pid for r in (0, 1)}
    victim.kill()  # SIGKILL: the replica's process is gone mid-training
    victim.wait()
    killed_at = run.last_step(2)
    run.quorum([0, 1])  # the controller's decision: replica 2 is out
    run.wait(lambda: run.last_step(0) >= killed_at + 5)
    run.quorum([0, 1, 2])  # let back in: it heals from a live peer at the next boundary
    run.finish([run.procs[0, 0], run.procs[1, 0], *standby])

    members = membership(run, 0)
    assert list(members) == list(range(1, steps + 1))  # every step applied, once
    assert membership(run, 1) == members
    assert {r["pid"] for r in run.lines(0)} == {survivors[0]}  # the same processes
    assert {r["pid"] for r in run.lines(1)} == {survivors[1]}
    out = [s for s, m in members.items() if m == [0, 1]]
    assert out and out == list(range(out[0], out[-1] + 1))  # one stretch without replica 2
    assert out[0] in (killed_at + 1, killed_at + 2) and members[steps] == [0, 1, 2]
    assert_trained_where_member(run, members, range(3), lost_at=killed_at)
    # The replacement was healed by replica 0 (the lowest member ahead), to the same bits.
    formed = [f for f in run.lines(2, kind="formed") if f["healed"]]
    assert formed and formed[-1]["source"] == 0 and formed[-1]["healed"] == [2]
    first = [s for s in run.lines(2) if s["step"] > killed_at][0]  # the replacement's first
    assert formed[-1]["steps"][0] == first["step"] - 1 == formed[-1]["steps"][1]
    states = [run.state(r) for r in range(3)]
    for other in states[1:]:
        assert all(torch.equal(a, b) for a, b in zip(states[0], other, strict=True))
    # Each step's update is the gradient of the loss over the tokens of its members.
    for got, want in zip(params_of(states[0]), reference(members), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_hung_replica_is_let_go_on_the_controllers_word_and_applies_nothing(run_of):
    """A replica that goes silent (SIGSTOP: no reset, no exit) holds the others' exchange only
    until the controller names a quorum without it (well before the exchange's timeout): they
    let the exchange go, exchange the same gradients in the new quorum and step on; the
    silent one, woken, has no peers to apply an update with."""
    steps = 24
    run = run_of(steps=steps, step_s=0.05)
    run.quorum([0, 1, 2])
    for r in range(3):
        run.start(r)
    run.wait(lambda: run.last_step(1) >= 4)
    run.procs[1, 0].send_signal(signal.SIGSTOP)
    time.sleep(0.3)  # the others now wait on it in their exchange
    stopped_at = run.last_step(1)
    run.quorum([0, 2])  # the controller's decision once its heartbeats went stale
    run.wait(lambda: any(f["quorum"] == 2 for f in run.lines(0, kind="formed")))
    run.procs[1, 0].send_signal(signal.SIGCONT)  # it wakes, its peers gone on without it
    run.finish([run.procs[0, 0], run.procs[2, 0]])
    run.wait(lambda: run.procs[1, 0].poll() is not None)  # its launch is over: it leaves
    assert "replica 1 is out of quorum 2" in run.lines(1, kind="out")[0]["error"]
    members = membership(run, 0)
    assert list(members) == list(range(1, steps + 1))
    assert membership(run, 2) == members
    # It was last a member at the step it was stopped in (its exchange may have completed just
    # before SIGSTOP), and applied nothing after that.
    last_in = max(s for s, m in members.items() if 1 in m)
    assert last_in in (stopped_at, stopped_at + 1)
    assert max(r["step"] for r in run.lines(1)) <= last_in
    assert all(m == [0, 2] for s, m in members.items() if s > last_in)
    failed = [f for f in run.lines(0, kind="failed") if f["step"] == last_in + 1]
    assert failed and "leaves out replica(s) [1]" in failed[0]["error"]
    states = [run.state(r) for r in (0, 2)]
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
    for got, want in zip(params_of(states[0]), reference(members), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _lost_then_let_back_in(run) -> None:
    """Replica 2's rank killed after its step 3, a quorum of replicas 0 and 1 until replica 0's
    step 8, then one of all three: replica 2's replacement is let in, to be healed."""
    victim = run.procs[2, 0]
    run.wait(lambda: run.last_step(2) >= 3)
    victim.kill()
    victim.wait()
    run.quorum([0, 1])
    run.wait(lambda: run.last_step(0) >= 8)
    run.quorum([0, 1, 2])


def test_a_replica_lost_during_its_heal_leaves_a_consistent_quorum(run_of):
    """The replacement dies as its heal begins: the healer's send fails, the member the heal
    did not concern fails its next exchange; both meet in the controller's next quorum at the
    same step and train on, each step applied once."""
    steps = 30
    run = run_of(steps=steps, step_s=0.05)
    dying = run.start(2, 1, "--die-healing")[0]
    run.wait(lambda: run.ready(2, 1))
    run.quorum([0, 1, 2])
    for r in range(3):
        run.start(r)
    _lost_then_let_back_in(run)  # the replacement joins, and dies healing
    run.wait(lambda: dying.poll() is not None)
    assert dying.returncode == 3
    run.quorum([0, 1])
    run.finish([run.procs[0, 0], run.procs[1, 0]])
    members = membership(run, 0)
    assert list(members) == list(range(1, steps + 1))
    assert membership(run, 1) == members
    assert {tuple(m) for m in members.values()} == {(0, 1, 2), (0, 1)}  # none applied in 3
    assert {r["quorum"] for r in run.lines(0)} == {1, 2, 4}
    states = [run.state(r) for r in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
    for got, want in zip(params_of(states[0]), reference(members), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_healer_lost_during_a_heal_leaves_a_consistent_quorum(run_of):
    """Replica 2 is lost and comes back; replica 0, the lowest member ahead, dies as it starts
    to heal it. The controller names a quorum of replicas 1 and 2: replica 1 heals replica 2,
    and both train on to the end with the same bits, each step applied once, by the members
    of its quorum."""
    steps = 30
    run = run_of(steps=steps, step_s=0.05)
    standby = run.start(2, 1)  # replica 2's replacement, waiting past quorum 1
    run.wait(lambda: run.ready(2, 1))
    run.quorum([0, 1, 2])
    run.start(0, 0, "--die-giving")
    run.start(1)
    run.start(2)
    healer = run.procs[0, 0]
    _lost_then_let_back_in(run)  # the replacement is let in; its healer dies giving
    run.wait(lambda: healer.poll() is not None)
    assert healer.returncode == 4
    run.quorum([1, 2])
    run.finish([run.procs[1, 0], *standby])
    members = membership(run, 1)
    assert list(members) == list(range(1, steps + 1))  # every step applied, once
    assert {tuple(m) for m in members.values()} <= {(0, 1, 2), (0, 1), (1, 2)}
    assert members[steps] == [1, 2]
    formed = [f for f in run.lines(2, kind="formed") if f["healed"]]
    assert formed and formed[-1]["source"] == 1 and formed[-1]["healed"] == [2]
    states = [run.state(r) for r in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
    for got, want in zip(params_of(states[0]), reference(members), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- the rules, without processes ----------------------------------------------------------

def test_a_quorum_file_is_read_whole_or_refused_in_one_line(tmp_path):
    path = tmp_path / "quorum.json"
    assert read_quorum(path) is None
    path.write_text(json.dumps({"version": 1, "id": 3, "members": [0, 2],
                                "store_addr": "10.0.0.1", "store_port": 29500}))
    assert read_quorum(path) == Quorum(id=3, members=[0, 2], store_addr="10.0.0.1",
                                       store_port=29500)
    for bad, says in ((dict(members=[2, 0]), "ascending"), (dict(members=[1, 1]), "each once"),
                      (dict(members=[]), "members"), (dict(id=0), "id"),
                      (dict(store_port=70000), "store_port"), (dict(extra=1), "extra")):
        record = {"version": 1, "id": 3, "members": [0, 2], "store_addr": "h",
                  "store_port": 1, **bad}
        path.write_text(json.dumps(record))
        with pytest.raises(QuorumError, match=says):
            read_quorum(path)
    path.write_text("x" * (65 << 10))
    with pytest.raises(QuorumError, match="bytes"):
        read_quorum(path)


def test_waiting_for_a_quorum_skips_those_that_leave_the_replica_out(tmp_path):
    path = tmp_path / "quorum.json"
    path.write_text(json.dumps(Quorum(id=2, members=[0, 1], store_addr="h",
                                      store_port=1).record()))
    with pytest.raises(QuorumError, match="replica 2"):
        wait_for_quorum(path, after=0, replica=2, timeout_s=0.05)
    assert wait_for_quorum(path, after=1, replica=1, timeout_s=0.05).id == 2
    with pytest.raises(QuorumError, match="after id 2"):
        wait_for_quorum(path, after=2, replica=1, timeout_s=0.05)
    # A rank that was a member: a newer quorum without its replica ends its launch, in words
    # its process takes for a lost peer's (it may go on in process into the next launch).
    with pytest.raises(ReplicaOut, match="replica 2 is out of quorum 2") as out:
        wait_for_quorum(path, after=1, replica=2, timeout_s=5, member=True)
    assert inprocess.peer_failure(out.value)
    assert wait_for_quorum(path, after=1, replica=0, timeout_s=0.05, member=True).id == 2


def test_the_heal_checksum_sees_a_flipped_bit_and_a_swap():
    flat = torch.arange(1000, dtype=torch.float32) / 7
    sums = checksum(flat)
    assert torch.equal(checksum(flat.clone()), sums)
    flipped = flat.clone()
    flipped.view(torch.int32)[500] ^= 1
    assert not torch.equal(checksum(flipped), sums)
    swapped = flat.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(checksum(swapped), sums)
    assert not torch.equal(checksum(flat[:-1]), checksum(flat[:-1].clone().fill_(0)))
    assert checksum(torch.ones(3, dtype=torch.bfloat16)).shape == (2,)
    # The device's arithmetic (run here on the host), the same properties.
    def on_device(t):
        return device_checksum(t.reshape(-1).view(torch.uint8))
    assert torch.equal(on_device(flat.clone()), on_device(flat))
    assert not torch.equal(on_device(flipped), on_device(flat))
    assert not torch.equal(on_device(swapped), on_device(flat))
    assert on_device(torch.ones(3, dtype=torch.bfloat16)).shape == (2,)  # padded to words


def test_a_switch_comes_two_steps_after_the_step_that_revealed_it():
    assert switch_step(7) == 9


def test_a_meeting_gives_up_when_the_controller_names_a_newer_quorum_even_one_with_all(tmp_path):
    """Quorum 3's replica 0 was relaunched on its way (its new ranks wait for a quorum after
    4): the controller's quorum 5 holds replica 0 again, so no member is "left out", yet
    replica 0 will never come to quorum 3's meeting. The others give up on it at once and
    meet in 5; a meeting that completed is formed, whatever the file says since."""
    from datetime import timedelta

    import torch.distributed as dist

    from optimus.parallel.quorum_file import meet

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    path = tmp_path / "quorum.json"
    three = Quorum(id=3, members=[0, 1, 2], store_addr="127.0.0.1", store_port=store.port)
    path.write_text(json.dumps(three.record()))
    store.set("optimus/quorum/3/0/here/2", "1")  # replica 2 came; replica 0 never will
    path.write_text(json.dumps(Quorum(id=5, members=[0, 1, 2], store_addr="127.0.0.1",
                                      store_port=store.port).record()))
    started = time.monotonic()
    with pytest.raises(QuorumError, match="quorum 3 did not meet before the controller named "
                                          "quorum 5"):
        meet(store, three, position=0, replica=1, path=path, timeout_s=30)
    assert time.monotonic() - started < 10  # not the 30 s bound: the newer word ended it
    store.set("optimus/quorum/3/0/here/0", "1")  # everyone came after all: it is formed
    meet(store, three, position=0, replica=1, path=path, timeout_s=30)


def _pair(run_source, run_receiver) -> list:
    """Two gloo ranks in threads of this process, on one store: what each returned or raised."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    store, out = dist.HashStore(), [None, None]

    def rank(i, fn):
        group = dist.ProcessGroupGloo(store, i, 2, timedelta(seconds=20))
        try:
            out[i] = fn(group)
        except Exception as e:  # noqa: BLE001 (returned to the test, which checks it)
            out[i] = e
    threads = [threading.Thread(target=rank, args=(i, fn))
               for i, fn in enumerate((run_source, run_receiver))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _state(fill: float | None = None) -> list[torch.Tensor]:
    """A large tensor (a message of its own), small ones of three dtypes (packed per dtype) and
    an empty one; `fill`: all of it that value (a receiver's own state), else distinct values."""
    gen = torch.Generator().manual_seed(3)
    state = [torch.randn(300_000, generator=gen), torch.randn(7, 5, generator=gen),
             torch.arange(11), torch.randn(4, generator=gen).to(torch.bfloat16),
             torch.randn(400, 700, generator=gen), torch.zeros(0), torch.tensor(5.0)]
    if fill is not None:
        for t in state:
            t.fill_(fill)
    return state


def test_a_heal_goes_in_pieces_and_is_checked_whole_before_any_is_taken():
    from datetime import timedelta

    from optimus.parallel import heal

    source, cpu, wait = _state(), torch.device("cpu"), timedelta(seconds=20)
    assert heal.pieces(source) == [[0], [4], [1, 5, 6], [2], [3]]  # the two large alone
    # small ones of one dtype are packed up to PIECE_MIN bytes a message, in order
    quarter = torch.zeros(heal.PIECE_MIN // 16)  # a quarter of PIECE_MIN in float32
    assert heal.pieces([quarter] * 9 + [torch.zeros(3, dtype=torch.int64)]) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8], [9]]
    mine = _state(fill=0.0)
    given, (tag, copy_in) = _pair(lambda g: heal.give(g, source, [1], cpu, wait),
                                  lambda g: heal.take(g, mine, 0, cpu, wait))
    assert given == tag == 6  # five pieces and the table: the notes' tag comes next
    # checked, and not taken yet: the replica's other ranks may not have theirs (positions.py)
    assert all(not t.numel() or bool((t == 0).all()) for t in mine)
    copy_in()
    assert all(torch.equal(a, b) for a, b in zip(source, mine, strict=True))

    def damaged(group):  # a byte of the second piece changed in transit; its table as sent
        plan = heal.pieces(source)
        sums = []
        for tag, index in enumerate(plan):
            flat = torch.cat([source[i].reshape(-1) for i in index])
            sums.append(heal.checksum(flat))
            if tag == 1:
                flat = flat.clone()
                flat.view(torch.uint8)[17] ^= 4
            group.send([flat], 1, tag).wait()
        group.send([torch.stack(sums)], 1, len(plan)).wait()
    mine = _state(fill=0.0)
    _, refused = _pair(damaged, lambda g: heal.take(g, mine, 0, cpu, wait))
    assert isinstance(refused, heal.HealError), refused
    assert all(not t.numel() or bool((t == 0).all()) for t in mine)  # nothing taken
