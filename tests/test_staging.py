"""Saves and snapshots copy the state behind the next step: what they hold is the state at their
step though training changes it right after, their host buffers are reused, and the fence the
next update passes waits for the copy only (optimus/checkpoint/staging.py).

One process, no process group: the checkpointer runs in thread mode, as PROCESS mode falls back
to without one; the stager is the same object in both (shared memory aside). On this CPU the
streams are torch.cpu's no-ops, and every call a GPU makes on them is made here too.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from optimus.checkpoint import snapshot
from optimus.checkpoint.saver import Checkpointer
from optimus.checkpoint.snapshot_files import point_name, shard_files
from optimus.checkpoint.staging import Stager, Streams
from optimus.checkpoint.state import ModelState, OptimizerState, Progress

HOLD_S = 0.5  # how long a copy is held back, where a test needs it to land after the update


class Run:
    """A model, its AdamW and progress counters, and the state dict a save takes."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.progress = Progress(8)
        self.state = {"model": ModelState(self.model),
                      "optim": OptimizerState(self.model, self.optimizer),
                      "progress": self.progress}

    def step(self, before_update=lambda: None) -> None:
        self.model(torch.randn(8, 16)).square().mean().backward()
        before_update()  # the trainer's: snapshots.fence()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.progress.advance(8 * 16)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Weights and AdamW moments, copied."""
        out = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, p in enumerate(self.model.parameters()):
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{i}/{k}"] = self.optimizer.state[p][k].clone()
        return out


def _assert_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


@pytest.fixture
def copies(monkeypatch):
    """Every staged tree the stagers return, in order; `hold[0]`: seconds each copy waits before
    it reads the state (the copy running late, behind a busy step)."""
    staged, hold = [], [0.0]
    real = Stager.copy

    def copy(self, tree, begun):
        time.sleep(hold[0])
        out = real(self, tree, begun)
        staged.append(out)
        return out
    monkeypatch.setattr(Stager, "copy", copy)
    return staged, hold


def test_a_save_holds_its_steps_state_though_the_next_update_comes_before_its_copy(
        tmp_path, copies):
    """The copy is held back HOLD_S: without the fence the update right after save() would land
    first, and step 1's checkpoint would hold step 2's weights and moments."""
    staged, hold = copies
    run = Run()
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, mode="thread")
    run.step()
    at_save = run.tensors()
    hold[0] = HOLD_S
    assert ckpt.save(1, run.state, run.progress.meta()) == "started"
    in_save = ckpt.stats.last_blocked_s
    assert in_save < HOLD_S  # save() returned before the copy
    run.step(ckpt.fence)  # as the trainer: the update waits for the copy
    blocked = ckpt.stats.last_blocked_s
    assert not torch.equal(run.model[0].weight, at_save["model/0.weight"])  # updated after
    assert ckpt.wait() == "committed"
    ckpt.close()

    fresh = Run(seed=1)
    Checkpointer(tmp_path, rank=0, world_size=1, mode="thread").load_latest(fresh.state)
    _assert_equal(fresh.tensors(), at_save)
    assert fresh.progress.step == 1
    assert blocked - in_save > HOLD_S * 0.5  # the fence's wait counts as blocked
    assert len(staged) == 1


def test_the_fence_waits_for_the_copy_only_once(tmp_path, copies):
    _, hold = copies
    run = Run()
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, mode="thread")
    run.step()
    hold[0] = HOLD_S
    assert ckpt.save(1, run.state, run.progress.meta()) == "started"
    assert ckpt._stager.pending
    before = ckpt.stats.last_blocked_s
    ckpt.fence()
    waited = ckpt.stats.last_blocked_s - before
    assert waited > HOLD_S * 0.5 and not ckpt._stager.pending
    ckpt.fence()  # nothing pending: free
    assert ckpt.stats.last_blocked_s - before == waited
    assert ckpt.wait() == "committed"
    ckpt.close()


def test_the_staging_buffers_are_reused_from_save_to_save(tmp_path, copies):
    staged, _ = copies
    run = Run()
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=2, mode="thread",
                        on_overlap="wait")
    held = []
    for step in (1, 2, 3):
        run.step()
        held.append(run.tensors())
        assert ckpt.save(step, run.state, run.progress.meta()) in ("started", "waited")
        assert ckpt.wait() == "committed"
    ckpt.close()
    assert len(staged) == 3
    for name in ("0.weight", "1.bias"):
        pointers = {s["model"][name].untyped_storage().data_ptr() for s in staged}
        assert len(pointers) == 1, name  # one host buffer for every save
    moments = {s["optim"][f"state.{name}.exp_avg"].untyped_storage().data_ptr()
               for s in staged for name in ("0.weight",)}
    assert len(moments) == 1
    # the last save's buffers hold the last step (the earlier ones were overwritten in place)
    assert torch.equal(staged[-1]["model"]["0.weight"], held[-1]["model/0.weight"])


def test_a_failed_copy_fails_the_save_and_the_update_does_not_wait_for_it(tmp_path, monkeypatch):
    def broken(tree, non_blocking=False):
        raise RuntimeError("host memory is gone")
    run = Run()
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, mode="thread")
    monkeypatch.setattr(ckpt._stager._state_dict_stager, "stage", broken)
    run.step()
    assert ckpt.save(1, run.state, run.progress.meta()) == "started"
    done = threading.Event()
    worker = threading.Thread(target=lambda: (run.step(), done.set()))
    worker.start()
    assert done.wait(30)  # the update went on
    assert ckpt.wait() == "failed"
    assert "host memory is gone" in ckpt.last_error
    ckpt.close()


def test_on_a_cpu_the_stager_takes_the_path_a_gpu_takes(tmp_path, monkeypatch):
    """Every stream call a GPU's copy makes is made here, on torch.cpu's streams and events:
    the mark on the training stream at the boundary, the side stream after it, the event after
    the copies, the training stream held on it at the fence. Pinned memory and non-blocking
    copies only with CUDA."""
    calls = []
    for name in ("mark", "side_after", "record_side", "hold"):
        real = getattr(Streams, name)
        monkeypatch.setattr(Streams, name, lambda self, *a, _real=real, _name=name: (
            calls.append(_name), _real(self, *a))[1])
    run = Run()
    for mode in ("thread", "process"):  # process: thread here (no process group), same stager
        ckpt = Checkpointer(tmp_path / mode, rank=0, world_size=1, mode=mode)
        assert type(ckpt._stager) is Stager
        run.step()
        calls.clear()
        assert ckpt.save(1, run.state, run.progress.meta()) == "started"
        run.step()
        assert ckpt.wait() == "committed"
        assert calls == ["mark", "side_after", "record_side", "hold"], mode
        assert ckpt._stager._streams.module is torch.get_device_module(
            torch.accelerator.current_accelerator().type
            if torch.accelerator.is_available() else "cpu")
        assert ckpt._stager.pinned is torch.cuda.is_available()
        ckpt.close()
    snaps = snapshot.Snapshots(tmp_path / "shm", rank=0, generation=0, every=1, layout="l",
                               agree_device=torch.device("cpu"))
    assert type(snaps._stager) is Stager
    calls.clear()
    snaps.after_step(1, 0.1, run.state)
    snaps.fence()
    snaps.close()
    assert calls == ["mark", "side_after", "record_side", "hold"]
    assert Checkpointer(tmp_path / "sync", rank=0, world_size=1, mode="sync")._stager is None


def test_streams_on_a_cpu_are_torch_cpus_and_copies_are_done_when_queued():
    streams = Streams()
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    assert streams.module is torch.cpu and streams.index is None
    stager = Stager()
    source = {"w": torch.arange(8.0)}
    begun = stager.begin()
    staged = stager.copy(source, begun)
    assert begun.queued.is_set() and begun.done is not None
    source["w"] += 1  # after the copy returned: the staged copy keeps step 0's values
    assert torch.equal(staged["w"], torch.arange(8.0))
    assert stager.fence() < 0.1 and stager.fence() == 0.0  # once, then nothing is pending
    assert not staged["w"].is_pinned()
    stager.release()


def test_snapshots_hold_their_steps_bytes_in_reused_buffers(tmp_path, copies):
    """Three snapshots, the second's copy held back HOLD_S: the next update waits for it."""
    staged, hold = copies
    run = Run()
    snaps = snapshot.Snapshots(tmp_path, rank=0, generation=0, every=1, layout="l",
                               agree_device=torch.device("cpu"))
    expected = {}
    for step in (1, 2, 3):
        run.step(snaps.fence)  # as the trainer: the last snapshot's fence before the update
        if step == 3:
            assert snaps.last.step == 2 and snaps.last.blocked_s > HOLD_S * 0.5
        expected[step] = run.tensors()
        if snaps._inflight is not None:
            snaps._inflight.result()  # the last one is written (else this one is skipped)
        hold[0] = HOLD_S if step == 2 else 0.0
        snaps.after_step(step, 0.1, run.state)
    snaps.close()
    for step in (1, 2, 3):
        saved = torch.load(shard_files(tmp_path / point_name(step, 0), 0)[0], weights_only=True)
        for name, value in saved["model"].items():
            assert torch.equal(value, expected[step][f"model/{name}"]), (step, name)
        assert saved["progress"]["step"] == step
    assert snaps.taken == 3 and snaps.skipped == 0
    pointers = {s["model"]["0.weight"].untyped_storage().data_ptr() for s in staged}
    assert len(staged) == 3 and len(pointers) == 1  # one host buffer for all three
